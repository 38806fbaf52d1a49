"""SGLang's acceptance counters under each name a server has used, and the estimate without an accepted count.

runtime/remote.py reads SGLang's per-request meta info: `spec_verify_ct` (verify steps), then the drafted and
accepted counts under the current names (`spec_num_proposed_drafts` / `spec_num_correct_drafts`) or the
older ones (`spec_draft_token_num` / `spec_accept_token_num`); a server that sends no accepted count gets
the accepted drafts derived from the streamed tokens (each verify step commits its accepted drafts plus one
token of the target's own; the first token comes from the prefill). The fake server (tests/support/fake_engine.py)
streams 10 one-character pieces, so the reply has 10 tokens, 9 of them after the first.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from support.fake_engine import FakeEngine

from dflash_cli.conversation import GenerationSettings
from dflash_cli.runtime.remote import RemoteRuntime
from dflash_cli.ui.cli import cli

PIECES = list("abcdefghij")  # 10 tokens: 9 decode tokens after the first


@pytest.fixture
def engine(request):
    server = FakeEngine(kind="sglang", pieces=PIECES, **getattr(request, "param", {}))
    yield server
    server.close()


def reply_stats(engine):
    """The final stats of one streamed reply, straight from the runtime."""
    runtime = RemoteRuntime(engine.url)
    try:
        steps = list(runtime.stream_chat([{"role": "user", "content": "hi"}], GenerationSettings()))
    finally:
        runtime.close()
    assert "".join(s.text for s in steps) == "abcdefghij"
    return steps[-1].stats


def generate(engine, *args):
    env = {"DFLASH_API_KEY": "", "DFLASH_MODEL": "", "DFLASH_CONFIG": ""}
    result = CliRunner().invoke(cli, ["generate", "--engine", engine.url, *args, "hi"], env=env)
    assert result.exit_code == 0, result.stderr
    return result


# The counts are chosen so that the accepted count the server sends (5) differs from the one the fallback
# derives from the stream (10 - 1 - 3 = 6): a server's count need not match the streamed tokens (a stop
# string cuts text the last step committed), and the client reports what the server counted.
@pytest.mark.parametrize("engine", [
    {"sglang_names": "current", "sglang_counts": (3, 45, 5)},
    {"sglang_names": "older", "sglang_counts": (3, 45, 5)},
    {"sglang_names": "older", "sglang_counts": (3, 45, 5), "sglang_meta_in": "choice"},
    {"sglang_names": "older", "sglang_counts": (3, 45, 5), "sglang_meta_in": "usage"},
], indirect=True, ids=["current", "older", "older-in-choice", "older-in-usage"])
def test_the_servers_drafted_and_accepted_counts_under_either_name(engine):
    stats = reply_stats(engine)
    assert stats.acceptance_reported
    assert (stats.steps, stats.drafted, stats.accepted) == (3, 45, 5)
    assert stats.generated_tokens == 10 and stats.decode_tokens == 9
    assert stats.acceptance_length == pytest.approx(3.0)  # 9 tokens after the first over 3 verify steps
    assert stats.draft_acceptance == pytest.approx(5 / 45)


@pytest.mark.parametrize("engine", [{"sglang_names": "older", "sglang_counts": (3, 45, 5)}], indirect=True)
def test_older_names_through_generate_json_and_verbose(engine):
    data = json.loads(generate(engine, "--json").stdout)
    assert "acceptance_reported" not in data  # present (False) only when the server said nothing
    assert (data["steps"], data["drafted"], data["accepted"]) == (3, 45, 5)
    assert data["acceptance_length"] == pytest.approx(3.0) and data["draft_acceptance"] == pytest.approx(5 / 45)
    verbose = generate(engine, "-v").stderr
    assert "3.00 tokens/step" in verbose and "11.1% (5/45 drafted)" in verbose


@pytest.mark.parametrize("engine", [{"sglang_names": "no_accepted", "sglang_counts": (3, 45, 5)}], indirect=True)
def test_without_an_accepted_count_the_accepted_drafts_come_from_the_streamed_tokens(engine):
    """9 tokens after the first in 3 verify steps, each adding one token of the target's own: 6 accepted."""
    stats = reply_stats(engine)
    assert stats.acceptance_reported
    assert (stats.steps, stats.drafted, stats.accepted) == (3, 45, 6)
    assert stats.acceptance_length == pytest.approx(3.0) and stats.draft_acceptance == pytest.approx(6 / 45)
    data = json.loads(generate(engine, "--json").stdout)
    assert (data["steps"], data["drafted"], data["accepted"]) == (3, 45, 6)


@pytest.mark.parametrize("engine", [{"sglang_names": "verify_only", "sglang_counts": (4, 0, 0)}], indirect=True)
def test_a_server_with_only_the_verify_count(engine):
    """The oldest servers send spec_verify_ct alone: tau is still known (9 / 4), the drafted count is not."""
    stats = reply_stats(engine)
    assert stats.acceptance_reported and stats.steps == 4
    assert stats.accepted == 9 - 4 and stats.drafted == 0
    assert stats.acceptance_length == pytest.approx(9 / 4)
    verbose = generate(engine, "-v").stderr
    assert "2.25 tokens/step" in verbose
    assert "draft acceptance:" in verbose and "not reported by the server" in verbose


@pytest.mark.parametrize("engine", [{"sglang_names": "verify_only", "sglang_counts": (12, 0, 0)}], indirect=True)
def test_the_derived_accepted_count_is_never_negative(engine):
    """More verify steps than tokens after the first (a count that includes steps whose tokens were cut)."""
    stats = reply_stats(engine)
    assert stats.steps == 12 and stats.accepted == 0


@pytest.mark.parametrize("engine", [{"sglang_names": "verify_only", "sglang_counts": (4, 0, 0)}], indirect=True)
def test_json_says_null_for_a_drafted_count_the_server_did_not_send(engine):
    """-v says "not reported by the server"; --json said 0 drafted and 0.0 acceptance, as if measured."""
    data = json.loads(generate(engine, "--json").stdout)
    assert data["steps"] == 4 and data["acceptance_length"] == pytest.approx(9 / 4)
    assert data["drafted"] is None and data["draft_acceptance"] is None


# SGLang's OpenAI endpoint need not stream meta info; its /metrics has the acceptance-length gauge
# `sglang:spec_accept_length` (the mean over its latest logging interval, every client's requests counted).
@pytest.mark.parametrize("engine", [{"sglang_meta_in": "none", "sglang_gauge": (3.0, 3.0)}], indirect=True)
def test_without_meta_info_the_acceptance_length_gauge_gives_tau(engine):
    """9 tokens after the first at 3 per verify step: 3 steps, 6 accepted drafts; no drafted count."""
    stats = reply_stats(engine)
    assert "/metrics" in engine.gets
    assert stats.acceptance_reported
    assert (stats.steps, stats.accepted, stats.drafted) == (3, 6, 0)
    assert stats.acceptance_length == pytest.approx(3.0)
    data = json.loads(generate(engine, "--json").stdout)
    assert data["acceptance_length"] == pytest.approx(3.0) and data["drafted"] is None


@pytest.mark.parametrize("engine", [{"sglang_meta_in": "none", "sglang_gauge": (0.0,)},
                                    {"sglang_meta_in": "none"}], indirect=True, ids=["zero", "absent"])
def test_a_gauge_of_zero_or_none_is_not_an_acceptance(engine):
    """A server that does not speculate exports 0: that is no data, not a tau of 0."""
    stats = reply_stats(engine)
    assert not stats.acceptance_reported and stats.steps == 0


@pytest.mark.parametrize("engine", [{"sglang_gauge": (5.0,), "sglang_counts": (3, 45, 5)}], indirect=True)
def test_the_requests_own_meta_info_wins_over_the_gauge(engine):
    stats = reply_stats(engine)
    assert (stats.steps, stats.drafted, stats.accepted) == (3, 45, 5)


def test_vllms_per_request_summary_gives_the_block_and_the_histogram():
    """`--per-request-spec-decode-metrics summary` (serve-cmd prints it): num_spec_tokens, not block_size."""
    spec = {"mean_acceptance_length": 4.0, "draft_acceptance_rate": 0.2, "acceptance_histogram": [1, 0, 1, 1],
            "num_spec_steps": 3, "num_accepted_draft_tokens": 5, "num_draft_tokens": 9, "num_spec_tokens": 3}
    server = FakeEngine(kind="vllm", pieces=PIECES, vllm_request_spec=spec)
    try:
        stats = reply_stats(server)
    finally:
        server.close()
    assert (stats.steps, stats.drafted, stats.accepted) == (3, 9, 5)
    assert stats.block_size == 4 and stats.speculative
    assert stats.committed_histogram == (1, 0, 1, 1)
