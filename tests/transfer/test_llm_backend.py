"""The LLM transfer backend, against a fake OpenAI-compatible client (no network)."""
from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import openai
import pytest
import torch

import torch_cubridge
import torch_cubridge.api as api
import torch_cubridge.pipeline as pipeline
from torch_cubridge.capture.trace import bind_example, capture
from torch_cubridge.errors import UnsupportedSpec
from torch_cubridge.ir.expr import call, const, scalar, var
from torch_cubridge.ir.program import Program
from torch_cubridge.lift.reference import lift_reference
from torch_cubridge.transfer.llm import llm_transfer
from torch_cubridge.transfer.llm_prompt import EXAMPLES, worked_examples

import zoo

ENV = ("CUBRIDGE_LLM_MODEL", "CUBRIDGE_LLM_BASE_URL", "CUBRIDGE_LLM_API_KEY", "OPENAI_API_KEY")


class FakeClient:
    """Shaped like openai.OpenAI for chat.completions.create; replays canned replies, records requests."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.requests: list[dict] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, *, model: str, messages: list[dict], **kw):
        self.requests.append({"model": model, "messages": [dict(m) for m in messages], **kw})
        content = self.replies.pop(0)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(role="assistant", content=content))])


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_openai_client(monkeypatch):
    made = []
    monkeypatch.setattr(openai, "OpenAI", lambda *a, **kw: made.append(kw) or pytest.fail("client constructed"))
    return made


def spec_args():
    return zoo.std(1, 2, 2, 16, 8, torch.float32)


@pytest.fixture(scope="module")
def softcap():
    """The causal softcap spec, its capture and the program the symbolic backend gives it."""
    fn, args = zoo.softcap_causal, spec_args()
    bound = bind_example(fn, args, {})
    return fn, bound, capture(fn, bound), torch_cubridge.transfer(fn, *args)


def without_notes(p: Program) -> Program:
    return replace(p, notes=())


# ---- configuration ----------------------------------------------------------------
def test_unconfigured_raises_without_touching_the_network(softcap, no_openai_client):
    _, _, cap, _ = softcap
    with pytest.raises(UnsupportedSpec, match="no LLM backend configured") as ei:
        llm_transfer(cap, reason="tensor-valued branch")
    assert "CUBRIDGE_LLM_MODEL" in str(ei.value) and "tensor-valued branch" in str(ei.value)
    assert ei.value.op == "transfer"
    assert no_openai_client == []


def test_model_without_endpoint_or_key_is_unconfigured(softcap, monkeypatch, no_openai_client):
    monkeypatch.setenv("CUBRIDGE_LLM_MODEL", "some-model")
    with pytest.raises(UnsupportedSpec, match="no LLM backend configured"):
        llm_transfer(softcap[2])
    assert no_openai_client == []


def test_environment_configures_the_openai_client(softcap, monkeypatch):
    _, _, cap, prog = softcap
    fake, made = FakeClient(prog.to_json()), []
    monkeypatch.setattr(openai, "OpenAI", lambda **kw: made.append(kw) or fake)
    monkeypatch.setenv("CUBRIDGE_LLM_MODEL", "local-model")
    monkeypatch.setenv("CUBRIDGE_LLM_BASE_URL", "http://localhost:8000/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fallback")
    out = llm_transfer(cap)
    assert made == [{"base_url": "http://localhost:8000/v1", "api_key": "sk-fallback"}]
    assert fake.requests[0]["model"] == "local-model"
    assert without_notes(out) == prog
    assert any("LLM backend (local-model)" in n for n in out.notes)


# ---- prompt and parsing ---------------------------------------------------------------
def test_correct_reply_gives_an_equal_program(softcap):
    _, _, cap, prog = softcap
    fake = FakeClient(prog.to_json())
    out = llm_transfer(cap, reason="pretend refusal", client=fake, model="x")
    assert without_notes(out) == prog
    assert len(fake.requests) == 1
    msgs = fake.requests[0]["messages"]
    assert msgs[0]["role"] == "system" and "JSON" in msgs[0]["content"]
    text = "\n".join(m["content"] for m in msgs)
    assert cap.graph.code.strip() in text
    assert str(lift_reference()) in text
    assert "pretend refusal" in text
    assert "q: tensor shape [1, 2, 16, 8] dtype float32" in text


def test_worked_examples_are_generated_from_the_symbolic_backend():
    ex = worked_examples()
    assert len(ex) == len(EXAMPLES)  # none silently dropped: the symbolic backend still accepts each
    for text in ex:
        Program.from_json(text.rsplit("\n", 1)[1]).validate()


def test_fenced_reply_with_prose_parses(softcap):
    _, _, cap, prog = softcap
    reply = f"Here is the program:\n```json\n{json.dumps(json.loads(prog.to_json()), indent=2)}\n```\nDone."
    assert without_notes(llm_transfer(cap, client=FakeClient(reply), model="x")) == prog


def test_garbage_then_valid_succeeds_on_second_attempt(softcap):
    _, _, cap, prog = softcap
    fake = FakeClient("I think the answer is a causal softcap kernel.", prog.to_json())
    out = llm_transfer(cap, client=fake, model="x", attempts=2)
    assert without_notes(out) == prog
    assert len(fake.requests) == 2
    second = fake.requests[1]["messages"]
    assert second[-2] == {"role": "assistant", "content": "I think the answer is a causal softcap kernel."}
    assert "rejected" in second[-1]["content"] and "no JSON object" in second[-1]["content"]


def test_invalid_program_error_is_fed_back(softcap):
    _, _, cap, prog = softcap
    bad = replace(prog, block_rule="none")  # a mask with block rule none fails validation
    fake = FakeClient(bad.to_json(), prog.to_json())
    assert without_notes(llm_transfer(cap, client=fake, model="x")) == prog
    assert "does not fit the mask" in fake.requests[1]["messages"][-1]["content"]


def test_unknown_argument_path_is_rejected(softcap):
    _, _, cap, prog = softcap
    bad = replace(prog, q=replace(prog.q, arg="query"))
    with pytest.raises(UnsupportedSpec, match="'query', which is not an argument path") as ei:
        llm_transfer(cap, client=FakeClient(bad.to_json()), model="x", attempts=1)
    assert ei.value.op == "llm"


def test_attempts_exhausted_raises(softcap):
    _, _, cap, _ = softcap
    fake = FakeClient("{not json", '{"op": "tanh"}')
    with pytest.raises(UnsupportedSpec, match="no valid program in 2 attempt") as ei:
        llm_transfer(cap, reason="why", client=fake, model="x", attempts=2)
    assert ei.value.op == "llm" and "why" in str(ei.value)
    assert len(fake.requests) == 2


def test_request_failure_is_unsupported(softcap):
    class Down(FakeClient):
        def _create(self, **kw):
            raise ConnectionError("endpoint unreachable")
    with pytest.raises(UnsupportedSpec, match="endpoint unreachable") as ei:
        llm_transfer(softcap[2], client=Down(), model="x")
    assert ei.value.op == "llm"


def test_inlined_literals_become_scalars(softcap):
    _, _, cap, prog = softcap
    (p0,) = [s for s in prog.scalars if s.name == "p0"]
    inlined = replace(prog, scalars=(p0,),
                      score=call("mul", call("tanh", call("div", call("mul", var("s"), scalar("p0")), const(30.0))),
                                 const(30.0)))
    out = llm_transfer(cap, client=FakeClient(inlined.to_json()), model="x")
    assert [(s.name, s.value) for s in out.scalars] == [("p0", p0.value), ("p1", 30.0), ("p2", 30.0)]
    assert "30.0" not in str(out.score)


def test_captured_constant_is_filled_in():
    fn, args = zoo.alibi_const, spec_args()
    cap = capture(fn, bind_example(fn, args, {}))
    prog = pipeline.symbolic_transfer(cap)
    (name,) = cap.constants
    obj = json.loads(prog.to_json())
    obj["extras"][0].update(arg=name, value=None)  # the model names the get_attr, not its values
    out = llm_transfer(cap, client=FakeClient(json.dumps(obj)), model="x")
    assert without_notes(out) == prog


# ---- end to end through transfer_bound (verification decides) ------------------------------
@pytest.fixture
def symbolic_refuses(monkeypatch, tmp_path):
    # a fresh disk cache: a program verified earlier for the same spec would be recalled instead
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "cache"))

    def refuse(cap):
        raise UnsupportedSpec("pretend the symbolic analysis cannot read this", op="aten.mystery")
    monkeypatch.setattr(pipeline, "symbolic_transfer", refuse)


def test_end_to_end_correct_program_is_verified(softcap, symbolic_refuses):
    fn, bound, _, prog = softcap
    fake = FakeClient(prog.to_json())
    res = api.transfer_bound(fn, bound, backend="auto", llm_options={"client": fake, "model": "x"})
    assert res.backend == "llm" and res.report.ok
    assert without_notes(res.program).structure() == prog.structure()
    assert "pretend the symbolic analysis" in fake.requests[0]["messages"][1]["content"]


def _softcap_changed(p: Program) -> Program:
    return replace(p, scalars=tuple(replace(s, value=25.0) if s.value == 30.0 and i == 1 else s
                                    for i, s in enumerate(p.scalars)))


@pytest.mark.parametrize("wrong", [
    pytest.param(_softcap_changed, id="softcap-scalar-changed"),
    pytest.param(lambda p: replace(p, mask=None, block_rule="none"), id="mask-dropped"),
])
def test_end_to_end_wrong_program_is_rejected_by_verification(softcap, symbolic_refuses, wrong):
    fn, bound, _, prog = softcap
    bad = wrong(prog)
    assert bad != prog
    with pytest.raises(UnsupportedSpec, match="failed verification") as ei:
        api.transfer_bound(fn, bound, backend="auto", llm_options={"client": FakeClient(bad.to_json()), "model": "x"})
    assert ei.value.op == "verify"


def test_symbolic_backend_alone_never_asks_the_llm(softcap, symbolic_refuses):
    fn, bound, _, prog = softcap
    fake = FakeClient(prog.to_json())
    with pytest.raises(UnsupportedSpec, match="pretend"):
        api.transfer_bound(fn, bound, backend="symbolic", llm_options={"client": fake, "model": "x"})
    assert fake.requests == []
