"""The FP8 quality benchmark's merge: repeated runs pooled per seed, providers renamed."""

import json
import runpy
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_fp8_quality.py"


def _run_file(path: Path, seed: int, provider_ne: dict[str, tuple[float, float]]) -> Path:
    """A single-seed result file as the script writes it (NE rows only matter here)."""
    rows = [
        {"case": task, "provider": provider, "mode": "eval", "metric": "ne", "value": ne}
        for provider, values in provider_ne.items()
        for task, ne in zip(("ctr", "cvr"), values, strict=True)
    ]
    meta = {"benchmark": "fp8_quality", "device": "test", "commit": "c0", "seed": seed}
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return path


def _merge(out: Path, *args: str) -> dict:
    """The script's command line, run in this process (a subprocess would import torch and
    gem-train again: ~10 s each on a 2-core CPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        patch.syspath_prepend(str(SCRIPT.parent))  # as `python SCRIPT` puts it first
        patch.setattr(sys, "argv", [str(SCRIPT), "--merge", *args, "--out", str(out)])
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return json.loads(out.read_text())


def _value(data: dict, case: str, provider: str, metric: str) -> float:
    (value,) = [
        r["value"]
        for r in data["rows"]
        if (r["case"], r["provider"], r["metric"]) == (case, provider, metric)
    ]
    return value


def test_merge_pools_repeats_and_renames(tmp_path):
    # Two sweeps over seeds 0 and 1: bf16 twice per seed, "old" (renamed to fp8) in the first
    # sweep, fp8 itself in the second.
    ne = {
        (0, "a"): {"bf16": (0.80, 0.70), "old": (0.81, 0.72)},
        (1, "a"): {"bf16": (0.90, 0.60), "old": (0.92, 0.61)},
        (0, "b"): {"bf16": (0.82, 0.71), "fp8": (0.83, 0.70)},
        (1, "b"): {"bf16": (0.88, 0.62), "fp8": (0.87, 0.64)},
    }
    files = {
        sweep: [_run_file(tmp_path / f"{sweep}{s}.json", s, ne[(s, sweep)]) for s in (0, 1)]
        for sweep in "ab"
    }
    first = _merge(tmp_path / "a.json", *map(str, files["a"]), "--rename", "old=fp8")
    assert first["meta"]["renamed"] == {"old": "fp8"}
    assert not [r for r in first["rows"] if r["provider"] == "old"]
    merged = _merge(tmp_path / "all.json", str(tmp_path / "a.json"), *map(str, files["b"]))
    assert merged["meta"]["earlier_merges"][0]["file"] == "a.json"
    for t, task in enumerate(("ctr", "cvr")):
        diffs = []
        for seed in (0, 1):
            fp8 = statistics.fmean([ne[(seed, "a")]["old"][t], ne[(seed, "b")]["fp8"][t]])
            bf16 = statistics.fmean([ne[(seed, w)]["bf16"][t] for w in "ab"])
            diffs.append((fp8 - bf16) / bf16)
            got = _value(merged, f"{task}/seed{seed}", "fp8", "ne_rel_diff_vs_bf16")
            assert abs(got - diffs[-1]) < 1e-12
        mean = _value(merged, task, "fp8", "ne_rel_diff_vs_bf16_mean")
        assert abs(mean - statistics.fmean(diffs)) < 1e-12
        assert _value(merged, task, "fp8", "runs") == 4.0
        assert _value(merged, task, "fp8", "seeds") == 2.0
    # Each run keeps its own row: the second run of a seed as /run2.
    assert _value(merged, "ctr/seed1/run2", "bf16", "ne") == ne[(1, "b")]["bf16"][0]
