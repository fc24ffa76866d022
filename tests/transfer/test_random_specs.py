"""Property: every attention spec composed at random from the ops the walker knows (tests/transfer/random_specs.py)
either transfers to a program that matches the spec in float64 at new values, or is refused cleanly
(UnsupportedSpec, never an internal error). Fixed seed; the stages are the pipeline's own (capture, the symbolic
transfer, verification), with the size guards' symbolic trace left to a few cases through tc.transfer."""
import random
import warnings

import pytest
import torch

import torch_cubridge as tc
from helpers import first, rel_err
from random_specs import build, draw, make_args
from torch_cubridge.capture.trace import bind_example, capture
from torch_cubridge.transfer import symbolic_transfer
from torch_cubridge.verify.cpu import verify_program
from torch_cubridge.verify.reference import to64

SEED, CASES, BATCH = 20240, 200, 25


def _clean(e: tc.UnsupportedSpec, spec) -> None:
    assert "internal error" not in str(e), f"{spec}: {e}"


def _matches(fn, prog, spec) -> None:
    args = make_args(spec)  # new values at the program's shape
    with torch.no_grad():
        got, ref = first(prog.run(*args)), first(fn(*(to64(a) for a in args)))
    assert rel_err(got, ref) < 1e-4, str(spec)


def _specs(batch: int) -> list:
    rng = random.Random(SEED)
    specs = [draw(rng) for _ in range(CASES)]
    return specs[batch * BATCH:(batch + 1) * BATCH]


@pytest.mark.parametrize("batch", range(CASES // BATCH))
def test_random_spec_transfers_and_matches_or_is_refused_cleanly(batch):
    torch.manual_seed(batch)
    for spec in _specs(batch):
        fn = build(spec)
        bound = bind_example(fn, make_args(spec), {})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                prog = symbolic_transfer(capture(fn, bound))
            except tc.UnsupportedSpec as e:
                _clean(e, spec)
                continue
            report = verify_program(fn, prog, bound, generic=False)
        assert report.ok or "Error" not in report.reason, f"{spec}: {report.summary()}"  # ran, and disagreed
        if report.ok:
            _matches(fn, prog, spec)


def test_random_specs_through_the_public_transfer():
    """A few of the same specs through tc.transfer itself (guards, generalisation, every verification trial)."""
    rng = random.Random(SEED + 1)
    for _ in range(6):
        spec = draw(rng)
        fn = build(spec)
        try:
            prog = tc.transfer(fn, *make_args(spec))
        except tc.UnsupportedSpec as e:
            _clean(e, spec)
            continue
        _matches(fn, prog, spec)


def test_generator_draws_every_choice():
    """The seeded draw reaches every layout, mask, bias and softmax spelling (else the property tests less)."""
    from random_specs import BIASES, LAYOUTS, MASKS, SOFTMAXES
    rng = random.Random(SEED)
    specs = [draw(rng) for _ in range(CASES)]
    for field, names in (("layout", LAYOUTS), ("mask", MASKS), ("bias", BIASES), ("softmax", SOFTMAXES)):
        assert {getattr(s, field) for s in specs} == set(names)
