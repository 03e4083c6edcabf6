#!/usr/bin/env bash
# Packs the Triton that uv.lock pins (what `uv sync` installs for users) for a GPU machine whose
# image has another one (our H200: Triton 3.6), so the GPU tests and benchmarks can run on both.
# Calls to that machine carry at most 64 MiB each, so the wheel (cp312, as the machine's Python)
# is stripped of what kernels do not use (AMD backend, CUPTI, the Blackwell ptxas), compressed
# with xz and split into parts .device-carry-triton/p0 ... (git-ignored).
#
#   bash benchmarks/pack_triton_for_device.sh          # ~4 minutes on 2 cores, 3 parts
#
# Then, in calls made while the machine stays warm, carry one part each:
#   carry [".device-carry-triton/pK"]:  mkdir -p /root/tri && cp .device-carry-triton/pK/part* /root/tri/
# and after the last one unpack and put it first on the path:
#   mkdir -p /tmp/tri && cat /root/tri/part* | xz -dc -T0 | tar -xf - -C /tmp/tri
#   export TRITON_BACKENDS_IN_TREE=1 PYTHONPATH=/tmp/tri:$PYTHONPATH
# (TRITON_BACKENDS_IN_TREE: discover the backends in the carried tree, not through the entry
# points of the image's own Triton.)
set -euo pipefail
top=$(git rev-parse --show-toplevel)
version=${TRITON_VERSION:-$(grep -A1 '^name = "triton"$' "$top/uv.lock" | sed -n 's/^version = "\(.*\)"/\1/p')}
out="$top/.device-carry-triton"
grep -qx '/.device-carry-triton/' "$top/.git/info/exclude" 2>/dev/null ||
  echo '/.device-carry-triton/' >> "$top/.git/info/exclude"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  -d "$work" "triton==$version"
(cd "$work" && unzip -q triton-*.whl 'triton/*')
rm -rf "$work"/triton/backends/amd "$work"/triton/backends/nvidia/lib/cupti* \
  "$work"/triton/backends/nvidia/bin/ptxas-blackwell
rm -rf "$out" && mkdir -p "$out"
tar -cf - -C "$work" triton | xz -T0 -9 > "$work/triton.tar.xz"
split -b 36000000 -d -a 1 "$work/triton.tar.xz" "$work/part"
for f in "$work"/part*; do
  i=${f##*/part}
  mkdir -p "$out/p$i" && mv "$f" "$out/p$i/"
done
du -sh "$out"/p*
echo "Triton $version in $(ls -d "$out"/p* | wc -l) parts under $out"
