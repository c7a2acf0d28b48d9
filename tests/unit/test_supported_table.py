"""The shipped supported table (automodel/models/supported.json) against transformers and the
code's rules, and the differential check itself on a handful of representative types (the full
sweep is the command ``automodel families --verify``, not a test)."""

from __future__ import annotations

import re

import pytest
import transformers

from automodel.config import ConfigError
from automodel.models import check_model_config
from automodel.models.support import causal_lm_types, read_table, supported_table, verify
from automodel.models.tiny import tiny_config
from automodel.models.verify import REASONS, backends_for

TABLE = read_table()
REASON_PREFIXES = tuple(template.split("{")[0] for template in REASONS.values())


def test_every_causal_lm_type_is_in_the_table_with_a_status_and_why():
    """Every type of the table's transformers release is listed; a newer release's new types are
    checked at setup instead (test_a_type_newer_than_the_table_is_checked_not_refused)."""
    if TABLE["transformers"] == transformers.__version__:
        assert set(TABLE["types"]) == set(causal_lm_types())
    for name, entry in TABLE["types"].items():
        assert entry["status"] in ("verified", "refused", "not_buildable"), name
        if entry["status"] == "verified":
            assert entry["backends"] == backends_for(entry.get("features", [])), name
            assert entry["max_error"] <= TABLE["rtol"], name
        elif entry["status"] == "refused":
            assert entry["reason"].startswith(REASON_PREFIXES), (name, entry["reason"])
        else:
            assert entry["reason"], name
    assert sum(e["status"] == "verified" for e in TABLE["types"].values()) >= 80


@pytest.mark.parametrize("name", sorted(set(causal_lm_types()) & set(TABLE["types"])))
def test_setup_runs_exactly_the_verified_types_and_names_the_reason_for_the_others(name):
    entry = supported_table()[name]
    try:
        config = tiny_config(name)
    except Exception:  # noqa: BLE001  (not buildable: the table says so)
        assert entry["status"] == "not_buildable"
        return
    if entry["status"] == "verified":
        check_model_config(config, "portable", entry)
        for backend in ("te", "varlen"):
            if backend not in entry["backends"]:
                with pytest.raises(ConfigError, match=f"model.attention_backend='{backend}' cannot compute"):
                    check_model_config(config, backend, entry, max_sample_tokens=2)
    else:
        with pytest.raises(
            ConfigError, match=f"model_type '{name}'.*refused.*{re.escape(entry['reason'][:30])}"
        ):
            check_model_config(config, "portable", entry)


# one type per feature: MLA (+MoE), chunked attention, logit scale + window, module discovery,
# own attention code under a dense mask; glm4 (post-norms, whose gradients cancel: float64 reference
# attention, not eager's float32 softmax); and refusals for their reasons
@pytest.mark.parametrize(
    "name, status, features_or_reason",
    [
        ("deepseek_v3", "verified", {"mla", "moe"}),
        ("llama4_text", "verified", {"chunk", "moe"}),
        ("cohere2", "verified", {"logit_scale", "window"}),
        ("gpt_neox", "verified", set()),
        ("falcon", "verified", {"dense_mask"}),
        ("glm4", "verified", set()),
        ("stablelm", "verified", {"dense_mask"}),  # drops the layout keyword, passes the mask on
        ("modernbert-decoder", "refused", "output head is more than lm_head"),
        ("bloom", "refused", "do not call transformers' AttentionInterface"),
    ],
)
def test_differential_check_on_representative_types(name, status, features_or_reason):
    verdict = verify(name)
    assert verdict.status == status, verdict
    if status == "verified":
        assert features_or_reason <= set(verdict.features)
        assert verdict.max_error <= 1e-5
    else:
        assert features_or_reason in verdict.reason
    assert TABLE["types"][name]["status"] == status


@pytest.mark.parametrize("name", sorted(set(causal_lm_types()) - set(TABLE["types"])))
def test_a_type_newer_than_the_table_is_checked_not_refused(name):
    """The installed transformers' types that the table's release lacked (none under the pinned
    versions of .ci/constraints.txt; a newer release's otherwise): each gets a verdict from the check
    at setup rather than a refusal for being absent."""
    verdict = verify(name)
    assert verdict.status in ("verified", "refused", "not_buildable"), verdict
    if verdict.status == "verified":
        check_model_config(tiny_config(name), "portable", {"status": "verified", **vars(verdict)})
