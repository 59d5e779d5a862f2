"""Shadow mode: the first divergence, its calls and its replayable log; the known differences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvfunc.cli import verify_log
from kvfunc.vllm import Divergence, DivergenceError, ShadowKVCacheManager
from kvfunc.vllm.harness import kv_cache_config, make_request

BS = 4


def shadow(windows: tuple[int | None, ...] = (None,), **kwargs: Any) -> ShadowKVCacheManager:
    """A shadow manager of 40 blocks of BS tokens, caching, events and stats on."""
    return ShadowKVCacheManager(kv_cache_config(40, BS, windows), max_model_len=256,
                                scheduler_block_size=BS, hash_block_size=BS, log_stats=True,
                                enable_kv_cache_events=True, **kwargs)


def admit(m: Any, rid: str, prompt: list[int], **kwargs: Any) -> Any:
    """Look the prompt up and admit it as vLLM's scheduler does."""
    req = make_request(rid, prompt, block_size=BS)
    blocks, hit, _ = m.get_computed_blocks(req)
    out = m.allocate_slots(req, len(prompt) - hit, hit, blocks, **kwargs)
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = len(prompt)
    return req, out


def test_a_block_taken_behind_the_managers_back_is_the_first_divergence(tmp_path: Path) -> None:
    """vLLM's pool handing out blocks by itself shows up at the next allocation, with its calls."""
    m = shadow()
    admit(m, "a", list(range(9)))
    m.primary.block_pool.get_new_blocks(2)  # what some of vLLM's tests do to its internals
    _, out = admit(m, "b", list(range(50, 59)))
    found = m.divergence
    assert isinstance(found, Divergence) and m.mirror is None
    assert "new block ids: vLLM ([6, 7, 8],), kvfunc ([4, 5, 6],)" in found.what
    assert found.call.startswith("allocate_slots('b', 9, 0")
    assert found.calls[0].startswith("get_computed_blocks('a'")
    assert found.replay() == found.state
    assert (found.state, len(found.deltas)) == verify_log(found.write(tmp_path / "d.jsonl"))
    assert [[6, 7, 8]] == list(out.get_block_ids())  # vLLM's answer still serves


def test_strict_mode_raises_at_the_divergence() -> None:
    """With strict=True the first difference raises DivergenceError with the report."""
    m = shadow(strict=True)
    admit(m, "a", list(range(9)))
    m.primary.block_pool.get_new_blocks(1)
    with pytest.raises(DivergenceError, match="kvfunc diverged from vLLM at allocate_slots"):
        admit(m, "b", list(range(50, 59)))


def test_the_log_is_written_where_the_environment_says(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFUNC_VLLM_SHADOW_LOG names a directory: the divergence's delta log lands there."""
    monkeypatch.setenv("KVFUNC_VLLM_SHADOW_LOG", str(tmp_path))
    m = shadow()
    admit(m, "a", list(range(9)))
    m.primary.block_pool.get_new_blocks(1)
    admit(m, "b", list(range(50, 59)))
    (path,) = tmp_path.iterdir()
    assert verify_log(path)[1] == len(m.divergence.deltas)  # type: ignore[union-attr]


def test_an_unmodelled_configuration_serves_without_a_mirror() -> None:
    """Shadow mode over what kvfunc does not model serves with vLLM alone and says why."""
    m = shadow(use_eagle=True)
    admit(m, "a", list(range(9)))
    assert (None, True) == (m.mirror, "does not model EAGLE" in (m.not_mirrored or ""))


# The documented differences: each pinned here, so a change of kvfunc's core shows.


def test_known_difference_an_evicted_held_block_is_cached_again() -> None:
    """After evict_blocks on a held block, kvfunc caches it again as its request goes on."""
    m = shadow()
    req, _ = admit(m, "a", [1] * 12)
    m.evict_blocks({1})
    for _ in range(BS):  # to the next block boundary, where kvfunc caches again
        req.append_output_token_ids(5)
        m.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    m.take_events()
    assert m.divergence is not None and m.divergence.what.startswith("KV events")


def test_known_difference_external_tokens_past_a_window() -> None:
    """Connector tokens past a window: kvfunc takes the skipped blocks, then lets them go."""
    m = shadow((None, 8))
    admit(m, "a", [1] * 13)
    admit(m, "b", [1] * 12 + [2] * 13, num_external_computed_tokens=12,
          delay_cache_blocks=True)
    assert m.divergence is not None
    assert m.divergence.what.startswith(("new block ids", "the request's block table",
                                         "free blocks"))


def test_known_difference_in_flight_tokens_of_a_shared_block_under_a_window() -> None:
    """A hit on a request's in-flight blocks: kvfunc frees its window's dead blocks early."""
    m = shadow((None, 8))
    a = make_request("a", [1] * 12, block_size=BS)
    m.allocate_slots(a, 8)
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, 8
    m.allocate_slots(a, 4)
    a.num_computed_tokens, a.num_in_flight_tokens = 12, 4
    admit(m, "b", [1] * 13)
    a.append_output_token_ids(3)
    m.allocate_slots(a, 1)
    assert m.divergence is not None
    assert m.divergence.what.startswith("the request's block table")
