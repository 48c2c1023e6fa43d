"""Recording switched off costs nothing: the compiled program of a model whose
recorders are in inference mode is the program of the same model without
recorders — the same operations, byte for byte — except that the recorders' cells,
which are still part of the model, are arguments passed through unchanged: returned
as they came, in the donated input's buffer (aliased, no copy), or not used at all.

`_program` reads a lowered program (StableHLO text) and takes the pass-through
arguments out, so that the rest can be compared exactly; the tests check that the
arguments taken out are exactly the recorders' cells."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_state as es


def _split_top(s):
    """Split `s` at the commas that are not inside brackets or quotes."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(s):
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
    if s[start:].strip():
        parts.append(s[start:].strip())
    return parts


def _closing(s, i):
    """The index of the bracket closing the one opened just before `s[i]`."""
    depth, quoted = 1, False
    for j in range(i, len(s)):
        ch = s[j]
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
            if depth == 0:
                return j
    raise AssertionError("unbalanced program text")


_ALIAS = re.compile(r"tf\.aliasing_output = (\d+) : i32")
_SHARDING = re.compile(r"sdy\.sharding = #sdy\.sharding<(@mesh, .*?\])>")
_CONSTRAINT = re.compile(
    r"(%\d+) = sdy\.sharding_constraint (%arg\d+) <(@mesh, .*?\])> :"
)


def _clean_attrs(decl):
    """A declaration `type {attributes}` without the aliasing and result
    annotations (their numbers change when arguments are taken out)."""
    decl = decl.strip()
    if not decl.endswith("}") or " {" not in decl:
        return decl
    kind, attrs = decl.split(" {", 1)
    items = [
        a
        for a in _split_top(attrs[:-1])
        if not a.startswith(("tf.aliasing_output", "jax.result_info"))
    ]
    return kind + (" {" + ", ".join(items) + "}" if items else "")


def _program(lowered):
    """`(program, passed_through)`: the lowered program's text with the arguments
    that it only passes through taken out (renumbered, without the aliasing and
    result annotations whose numbers that changes), and those arguments' types."""
    text = lowered.as_text()
    head = re.search(r"func\.func public @main\(", text)
    assert head is not None
    a_end = _closing(text, head.end())
    args = _split_top(text[head.end() : a_end])
    r_start = text.index("-> (", a_end) + len("-> (")
    r_end = _closing(text, r_start)
    results = _split_top(text[r_start:r_end])
    b_start = text.index("{\n", r_end) + 2
    b_end = text.index("\n  }\n", b_start)
    lines = text[b_start:b_end].split("\n")
    ret = lines[-1].strip()
    assert ret.startswith("return "), ret
    operands = _split_top(ret[len("return ") : ret.index(" : ")])
    # On a mesh each output is constrained to its sharding: an argument returned
    # under the very sharding it came with is still only passed through.
    declared = {
        a.split(":", 1)[0].strip(): _SHARDING.search(a).group(1)
        for a in _split_top(text[head.end() : a_end])
        if _SHARDING.search(a)
    }
    kept_lines = []
    for line in lines[:-1]:
        m = _CONSTRAINT.match(line.strip())
        if m and declared.get(m.group(2)) == m.group(3):
            operands = [m.group(2) if o == m.group(1) else o for o in operands]
        else:
            kept_lines.append(line)
    # renumber the values the removed lines left gaps in
    order = {}
    for line in kept_lines:
        for v in re.findall(
            r"(%\d+)(?::\d+)? = |(%\d+), ", line.split(" = ")[0] + " = "
        ):
            for name in v:
                if name and name not in order:
                    order[name] = f"%{len(order)}"
    renum = re.compile(r"%\d+\b")
    kept_lines = [
        renum.sub(lambda m: order.get(m.group(0), m.group(0)), ln) for ln in kept_lines
    ]
    operands = [
        renum.sub(lambda m: order.get(m.group(0), m.group(0)), o) for o in operands
    ]
    lines = [*kept_lines, lines[-1]]
    body = "\n".join(lines[:-1])

    names = [a.split(":", 1)[0].strip() for a in args]
    used = {n for n in names if re.search(re.escape(n) + r"\b", body)}
    through = [k for k, n in enumerate(names) if n not in used]
    dropped_results = set()
    for k in through:
        alias = _ALIAS.search(args[k])
        positions = [p for p, o in enumerate(operands) if o == names[k]]
        if positions:
            # returned as it came: only free if it is the donated input's buffer
            assert alias is not None and int(alias.group(1)) in positions, args[k]
            dropped_results.update(positions)
    rename = {}
    kept_args = []
    for k, a in enumerate(args):
        if k in through:
            continue
        new = f"%arg{len(kept_args)}"
        rename[names[k]] = new
        kept_args.append(new + ":" + _clean_attrs(a.split(":", 1)[1]))

    def sub(s):
        return re.sub(r"%arg\d+\b", lambda m: rename.get(m.group(0), m.group(0)), s)

    kept_ops = [sub(o) for p, o in enumerate(operands) if p not in dropped_results]
    kept_results = [
        _clean_attrs(r) for p, r in enumerate(results) if p not in dropped_results
    ]
    program = "\n".join(
        [
            text[: head.start()],
            ", ".join(kept_args),
            ", ".join(kept_results),
            sub(body),
            "return " + ", ".join(kept_ops),
            text[b_end:],
        ]
    )
    types = sorted(args[k].split(":", 1)[1].split("{")[0].strip() for k in through)
    return program, types


class Net(eqx.Module):
    l1: eqx.nn.Linear
    bn: es.nn.BatchNorm
    l2: eqx.nn.Linear
    recs: list

    def __init__(self, *, recorders, batch=8, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(3, 4, key=k1)
        self.bn = es.nn.BatchNorm(4)
        self.l2 = eqx.nn.Linear(4, 1, key=k2)
        self.recs = (
            [
                es.nn.Record("std", "max_abs", "dead_fraction"),
                es.nn.Capture((batch, 4)),
            ]
            if recorders
            else []
        )

    def __call__(self, x):
        h = jax.nn.relu(self.bn(jax.vmap(self.l1)(x)))
        for r in self.recs:
            h = r(h)
        return jax.vmap(self.l2)(h)


# the recorders' cells: MeanStd's count/mean/m2, Max's value/count, Mean's
# total/weight; Capture's value and count
RECORDER_CELLS = sorted(["tensor<f32>"] * 7 + ["tensor<8x4xf32>", "tensor<i32>"])


def _models(ref_mode):
    key = jax.random.key(0)
    plain = Net(recorders=False, key=key)
    with_rec = Net(recorders=True, key=key)
    off = es.inference_mode(with_rec, only=es.nn.Recorder)
    if ref_mode:
        plain, with_rec, off = map(es.to_refs, (plain, with_rec, off))
    return plain, off, with_rec


def _loss(m, x):
    return jnp.mean(m(x) ** 2)


X = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_make_step_with_recording_off_is_the_recorder_free_program(ref_mode):
    plain, off, on = _models(ref_mode)
    step = es.make_step(_loss, optax.adam(1e-3))
    p_plain, through_plain = _program(step.lower(plain, step.init(plain), X))
    p_off, through_off = _program(step.lower(off, step.init(off), X))
    p_on, through_on = _program(step.lower(on, step.init(on), X))
    assert through_plain == []  # every argument of the plain step is used
    assert p_off == p_plain
    # the recorders' cells are passed through, donated and aliased (no copy), in
    # both modes: a ref-mode step runs the value-mode program on its refs' arrays
    assert through_off == RECORDER_CELLS
    # recording on is a different program (the comparison can fail); its only
    # unread input is the capture's old value, which the capture overwrites
    assert p_on != p_plain
    assert through_on == ["tensor<8x4xf32>"]


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_make_apply_with_recording_off_is_the_recorder_free_program(ref_mode):
    plain, off, on = _models(ref_mode)
    call = es.make_apply(lambda m, x: m(x))
    p_plain, _ = _program(call.lower(plain, X))
    p_off, _ = _program(call.lower(off, X))
    assert p_off == p_plain
    assert _program(call.lower(on, X))[0] != p_plain


def test_evaluation_with_recording_off_is_the_recorder_free_program():
    plain, off, _ = _models(False)
    forward = eqx.filter_jit(lambda m, x: m(x))
    ev_plain, ev_off = (eqx.nn.inference_mode(m) for m in (plain, off))
    p_plain, _ = _program(forward.lower(ev_plain, X))
    p_off, through = _program(forward.lower(ev_off, X))
    assert p_off == p_plain
    assert through == []  # jit drops the unused inputs (keep_unused=False)


def test_the_normaliser_only_drops_pass_through_arguments():
    # a program that uses every input is unchanged (up to the annotations)
    lowered = jax.jit(lambda a, b: (a + b, a * 2)).lower(jnp.ones(3), jnp.ones(3))
    program, through = _program(lowered)
    assert through == [] and "stablehlo.add %arg0, %arg1" in program
    # an argument returned unchanged but not donated is a copy: refused
    copied = jax.jit(lambda a, b: (a + 1, b)).lower(jnp.ones(3), jnp.ones(3))
    with pytest.raises(AssertionError):
        _program(copied)
    # donated and returned unchanged: passed through
    aliased = jax.jit(lambda a, b: (a + 1, b), donate_argnums=1).lower(
        jnp.ones(3), jnp.ones(2)
    )
    program, through = _program(aliased)
    assert through == ["tensor<2xf32>"] and "%arg1" not in program
