"""`raylane bench autoscale`'s reading of a step: when the replicas came, when the output rate caught
up, and which streams were lost."""

import argparse

from raylane.bench.autoscale import plot, print_result, summarize
from raylane.bench.stream_load import Stream


def test_the_step_is_read_from_the_replica_samples_and_the_streams_finish_times(tmp_path, capsys):
    args = argparse.Namespace(min_replicas=2, max_replicas=4, duration_s=60.0, max_tokens=10)
    replicas = [(0.0, 2, 0), (1.0, 2, 0), (2.0, 2, 2)] + [(float(t), 2, 2) for t in range(3, 10)]
    replicas += [(float(t), 3, 1) for t in range(10, 20)] + [(float(t), 4, 0) for t in range(20, 60)]
    # 2 streams a second finish over the first 20 s, 8 a second after: 20 then 80 tokens/s.
    streams = [Stream(sent=t / 2, e2e=0.0, output_tokens=10) for t in range(40)]
    streams += [Stream(sent=20 + t / 8, e2e=0.0, output_tokens=10) for t in range(320)]
    streams += [Stream(sent=5.0, status=503, error="busy"), Stream(sent=6.0, e2e=1.0, output_tokens=3)]

    result = summarize(streams, replicas, args)

    assert result["first_replica_starting_s"] == 2
    assert result["first_new_replica_s"] == 10 and result["all_replicas_s"] == 20
    assert result["output_tokens_per_s_plateau"] == 80 and result["rate_at_90pct_of_plateau_s"] == 20
    assert result["lost"] == 2 and result["streams"] == 362
    assert [e["status"] for e in result["lost_examples"]] == [503, 200]
    print_result(result, args)
    assert (
        "| 2 -> 4 (most 4) |     362 |            2 s |          10 s |        20 s |"
        in capsys.readouterr().out
    )
    plot(result, tmp_path / "autoscale.png")
    assert (tmp_path / "autoscale.png").stat().st_size > 0
