"""/metrics shows the engine's accepted drafts per draft position as vLLM does: the counter
`vllm:spec_decode_num_accepted_tokens_per_pos` with a `position` label (0: the first draft) beside
`model_name`, and nothing of it while speculation is off."""

from __future__ import annotations

from engine_metrics_scrape import scrape

NAME = "vllm:spec_decode_num_accepted_tokens_per_pos"


def test_accepted_tokens_per_position_are_labelled_by_position() -> None:
    families = scrape({"spec_decode_num_accepted_tokens_total": 9, "spec_decode_num_accepted_tokens_per_pos": [5, 3, 1, 0]})
    family = families[NAME]
    assert family.type == "counter"
    samples = {s.labels["position"]: s.value for s in family.samples if s.name == f"{NAME}_total"}
    assert samples == {"0": 5.0, "1": 3.0, "2": 1.0, "3": 0.0}
    assert all(s.labels["model_name"] == "smol" for s in family.samples)


def test_no_per_position_counter_while_speculation_is_off() -> None:
    families = scrape({"spec_decode_num_accepted_tokens_total": 0, "spec_decode_num_accepted_tokens_per_pos": []})
    assert NAME not in families
    assert "vllm:spec_decode_num_accepted_tokens" in families
