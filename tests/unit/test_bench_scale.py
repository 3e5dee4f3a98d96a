"""`raylane bench scale`'s plan: which fleets run side by side, and which one after the other."""

from raylane.bench import fleet

WANTED = ["raylane", "vllm-router:cache_aware", "direct"]


def test_fleets_that_do_not_fit_in_memory_together_are_measured_one_after_the_other(monkeypatch):
    """On a 24 GiB box (~20 GiB free) 16 replicas of raylane and 16 sim-servers run at once and are
    alternated point by point; 64 of each do not fit, so raylane's fleet runs first, alone."""
    monkeypatch.setattr(fleet, "available_mib", lambda: 20_000)
    assert fleet.phases(WANTED, 16, "auto") == [WANTED]
    assert fleet.phases(WANTED, 64, "auto") == [["raylane"], ["vllm-router:cache_aware", "direct"]]
    assert fleet.phases(WANTED, 64, "together") == [WANTED]
    assert fleet.phases(WANTED, 1, "apart") == [["raylane"], ["vllm-router:cache_aware", "direct"]]
    assert fleet.phases(["direct"], 64, "apart") == [["direct"]]  # one fleet: nothing to split
