"""`raylane bench accuracy` on the real model: the quantized forms scored against float32 on ShareGPT
replies, through raylane's decode kernels and torch's."""

import json

from raylane.cluster.cli import main
from raylane.parallel import int4, quantization


def test_int4_agrees_with_float32_through_both_kernels(tmp_path, capsys):
    argv = ["bench", "accuracy", "--quantization", "int4", "--num-seqs", "2", "--reply-tokens", "32"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "accuracy.json").read_text())
    assert report["positions"] == 64 and "AVX" in report["machine"]["cpu"]
    assert [(r["weights"], r["kernel"]) for r in report["rows"]] == [("int4", "raylane"), ("int4", "torch")]
    # Over 4,682 positions both kernels agree with float32 at 97% (bench/README.md); 64 positions here.
    for row in report["rows"]:
        assert row["top1_agreement"] >= 0.85 and row["logit_error"] <= 0.1, row
    assert "top-1 = float32's" in capsys.readouterr().out
    # The measurement's settings do not outlive it.
    assert int4.DENSE_MIN_TOKENS == quantization.DENSE_MIN_TOKENS == 128
