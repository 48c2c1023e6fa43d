"""`Rng` and `Dropout` against a hand-threaded `jax.random.split` loop and
`jax.random.bernoulli` masks, in both storage modes, through make_step, and under
vmap (ensembles and per-example misuse)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


MODES = ["value", "ref"]
B, IN, W = 4, 5, 32


def as_mode(model, mode):
    return es.to_refs(model) if mode == "ref" else model


def call(model, mode, fn, *args):
    """`fn(model, *args)`, writing state, in either mode: returns (out, model)."""
    if mode == "ref":
        return fn(model, *args), model
    return es.apply(fn, model, *args)


def draw(rng, mode, num=None):
    """One draw, in either mode; returns (key, rng)."""
    if mode == "ref":
        return rng.next_key(num), rng
    return es.apply(lambda r: r.next_key(num), rng)


def ref_keys(key, n):
    """The hand-threaded stream: `key, sub = split(key)` n times."""
    subs = []
    for _ in range(n):
        key, sub = jax.random.split(key)
        subs.append(sub)
    return subs, key


def ref_dropout(key, x, p):
    """Dropout written from scratch: bernoulli(1 - p) mask, kept units / (1 - p)."""
    keep = np.asarray(jax.random.bernoulli(key, 1.0 - p, x.shape))
    return np.where(keep, np.asarray(x) / (1.0 - p), 0.0), keep


def key_bits(k):
    k = jnp.asarray(k)
    if jnp.issubdtype(k.dtype, jax.dtypes.prng_key):
        k = jax.random.key_data(k)
    return np.asarray(k)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("typed", [True, False])
def test_rng_stream_matches_split_loop(mode, typed):
    seed = jax.random.key(5) if typed else jax.random.PRNGKey(5)
    rng = as_mode(es.nn.Rng(seed), mode)
    got = []
    for _ in range(4):
        k, rng = draw(rng, mode)
        got.append(k)
    want, last = ref_keys(seed, 4)
    for g, w in zip(got, want):
        assert jnp.asarray(g).dtype == jnp.asarray(w).dtype  # keeps typed / raw
        np.testing.assert_array_equal(key_bits(g), key_bits(w))
    np.testing.assert_array_equal(key_bits(rng.key[...]), key_bits(last))
    assert len({tuple(key_bits(g).ravel()) for g in got}) == 4


@pytest.mark.parametrize("mode", MODES)
def test_rng_batch_of_keys_and_int_seed(mode):
    rng = as_mode(es.nn.Rng(3), mode)
    keys, rng = draw(rng, mode, num=3)
    ks = jax.random.split(jax.random.key(3), 4)
    assert keys.shape == (3,)
    np.testing.assert_array_equal(key_bits(keys), key_bits(ks[1:]))
    np.testing.assert_array_equal(key_bits(rng.key[...]), key_bits(ks[0]))


def test_rng_rejects_non_keys():
    from eqx_state.nn._rng import as_key  # the check behind the annotations

    for bad in [jnp.zeros(3), jnp.zeros(2, jnp.int32), "seed"]:
        with pytest.raises(TypeError, match="seed"):  # jaxtyping's check, or ours
            es.nn.Rng(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="integer seed or a JAX PRNG key"):
            as_key(bad)  # type: ignore[arg-type]


def test_rng_value_mode_write_outside_step_raises():
    rng = es.nn.Rng(0)
    with pytest.raises(es.StateWriteError, match="value mode and no step is running"):
        rng.next_key()


class Net(eqx.Module):
    lin: eqx.nn.Linear
    drop: es.nn.Dropout

    def __init__(self, key, seed, p=0.5):
        self.lin = eqx.nn.Linear(IN, W, key=key)
        self.drop = es.nn.Dropout(p, key=seed)

    def __call__(self, x):
        h = jax.vmap(self.lin)(x)
        return h, self.drop(h)


def loss_fn(model, x):
    h, y = model(x)
    return jnp.mean(y**2), (h, y)


def train(mode, seed, p, steps=4):
    """`steps` make_step steps; returns the (h, y) of every step and the model."""
    model = as_mode(Net(jax.random.key(0), seed, p), mode)
    step = es.make_step(loss_fn, optax.sgd(0.1), has_aux=True)
    opt_state = step.init(model)
    x = jax.random.normal(jax.random.key(1), (B, IN))
    outs = []
    for _ in range(steps):
        model, opt_state, (h, y) = step(model, opt_state, x)
        outs.append((np.asarray(h), np.asarray(y)))
    assert step.trace_count == 1
    return outs, model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", [0.25, 0.5, 0.9])
def test_dropout_in_make_step_matches_bernoulli_reference(mode, p):
    seed = jax.random.key(11)
    outs, model = train(mode, seed, p)
    keys, last = ref_keys(seed, len(outs))
    masks = []
    for (h, y), k in zip(outs, keys):
        want, keep = ref_dropout(k, h, p)
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=0)
        # kept units are scaled by exactly 1 / (1 - p), dropped ones are zero
        np.testing.assert_allclose(y[keep], h[keep] / (1 - p), rtol=1e-6)
        assert np.all(y[~keep] == 0)
        masks.append(keep)
    # a fresh mask on every step
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            assert not np.array_equal(masks[i], masks[j])
    np.testing.assert_array_equal(key_bits(model.drop.rng.key[...]), key_bits(last))


def test_dropout_keep_rate_and_mean():
    """Statistics of a large mask: keep rate ~ 1 - p, E[dropout(x)] ~ x."""
    p, n = 0.3, 200_000
    drop = es.to_refs(es.nn.Dropout(p, key=2))
    y = np.asarray(drop(jnp.ones(n)))
    keep_rate = np.mean(y != 0)
    tol = 5 * np.sqrt(p * (1 - p) / n)
    assert abs(keep_rate - (1 - p)) < tol
    assert abs(y.mean() - 1.0) < 5 * np.sqrt(p / (1 - p) / n)
    np.testing.assert_allclose(np.unique(y), [0.0, 1 / (1 - p)], rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_run_other_seed_differs(mode):
    a, _ = train(mode, 7, 0.5)
    b, _ = train(mode, 7, 0.5)
    c, _ = train(mode, 8, 0.5)
    for (_, ya), (_, yb) in zip(a, b):
        np.testing.assert_array_equal(ya, yb)
    assert not all(np.array_equal(ya != 0, yc != 0) for (_, ya), (_, yc) in zip(a, c))


@pytest.mark.parametrize("mode", MODES)
def test_value_and_ref_modes_agree(mode):
    a, _ = train("value", 9, 0.5)
    b, _ = train("ref", 9, 0.5)
    for (_, ya), (_, yb) in zip(a, b):
        np.testing.assert_array_equal(ya, yb)


@pytest.mark.parametrize("mode", MODES)
def test_inference_mode_no_dropout_no_write(mode):
    drop = as_mode(es.nn.Dropout(0.5, key=4), mode)
    before = key_bits(drop.rng.key[...])
    ev = eqx.nn.inference_mode(drop)
    x = jax.random.normal(jax.random.key(0), (3, 6))
    # value mode: callable eagerly, no step needed (nothing is written)
    np.testing.assert_array_equal(ev(x), x)
    y, ev2 = es.apply(lambda m, x: m(x), ev, x)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(key_bits(ev2.rng.key[...]), before)
    np.testing.assert_array_equal(key_bits(drop.rng.key[...]), before)
    # call-time override, and back to training
    np.testing.assert_array_equal(ev(x, inference=True), x)
    tr = eqx.nn.inference_mode(ev, False)
    y, tr = es.apply(lambda m, x: m(x), tr, x)
    want, _ = ref_dropout(ref_keys(jax.random.key(4), 1)[0][0], x, 0.5)
    np.testing.assert_allclose(y, want, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", [0.0, 1.0])
def test_p0_identity_p1_zeros_no_draw(mode, p):
    drop = as_mode(es.nn.Dropout(p, key=4), mode)
    before = key_bits(drop.rng.key[...])
    x = jax.random.normal(jax.random.key(0), (3, 6))
    y, drop = es.apply(lambda m, x: m(x), drop, x)
    np.testing.assert_array_equal(y, x if p == 0 else np.zeros_like(x))
    np.testing.assert_array_equal(key_bits(drop.rng.key[...]), before)
    grad = jax.grad(lambda x: jnp.sum(es.apply(lambda m, x: m(x), drop, x)[0]))(x)
    np.testing.assert_array_equal(grad, np.full(x.shape, 1.0 - p, np.float32))


def test_dropout_gradient_is_mask_over_q():
    p = 0.25
    drop = es.nn.Dropout(p, key=6)
    x = jax.random.normal(jax.random.key(0), (40,))

    def f(x, drop):
        y, _ = es.apply(lambda m, x: m(x), drop, x)
        return jnp.sum(y)

    g = jax.grad(f)(x, drop)
    _, keep = ref_dropout(ref_keys(jax.random.key(6), 1)[0][0], x, p)
    np.testing.assert_allclose(g, np.where(keep, 1 / (1 - p), 0.0), rtol=1e-6)


def test_dropout_constructor_and_call_errors():
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        es.nn.Dropout(1.5, key=0)
    with pytest.raises(TypeError, match=r"eqx\.nn\.Shared"):
        es.nn.Dropout(0.5, rng=es.nn.Rng(1))
    keyless = es.nn.Dropout(0.5)
    with pytest.raises(ValueError, match="no random stream and no key"):
        keyless(jnp.ones(3))
    # an explicit key works like eqx.nn.Dropout, and does not touch a stream
    k = jax.random.key(3)
    np.testing.assert_array_equal(
        keyless(jnp.ones(8), key=k), eqx.nn.Dropout(0.5)(jnp.ones(8), key=k)
    )
    drop = es.to_refs(es.nn.Dropout(0.5, key=1))
    before = key_bits(drop.rng.key[...])
    np.testing.assert_array_equal(drop(jnp.ones(8), key=k), keyless(jnp.ones(8), key=k))
    np.testing.assert_array_equal(key_bits(drop.rng.key[...]), before)


def _second_rng(pair):
    return pair[1].rng


def _first_rng(pair):
    return pair[0].rng


class SharedStream(eqx.Module):
    """Two Dropouts drawing from one stream, declared with `eqx.nn.Shared`."""

    shared: eqx.nn.Shared

    def __init__(self, seed):
        a = es.nn.Dropout(0.5, key=seed)
        b = es.nn.Dropout(0.5, key=seed + 1)  # its stream is replaced by `a`'s
        self.shared = eqx.nn.Shared((a, b), _second_rng, _first_rng)

    def __call__(self, x):
        a, b = self.shared()
        return a(x), b(x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["eager", "apply", "filter_jit", "make_apply", "copy"])
def test_shared_rng_is_one_stream(mode, how):
    """Layers declared to share a stream draw consecutive keys of one stream, the same
    way under every way of running the model."""
    model = as_mode(SharedStream(12), mode)
    x = jnp.ones(64)
    run = lambda m, x: es.apply(lambda m, x: m(x), m, x)  # noqa: E731
    if how == "eager":
        if mode == "value":
            pytest.skip("value mode writes only inside apply / a step")
        run = lambda m, x: (m(x), m)  # noqa: E731
    elif how == "filter_jit":
        run = eqx.filter_jit(run)
    elif how == "make_apply":
        run = es.make_apply(lambda m, x: m(x))
    elif how == "copy" and mode == "value":
        # copies every array: nothing changes
        model = jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, model)
    keys, _ = ref_keys(jax.random.key(12), 4)
    for step in range(2):
        (ya, yb), model = run(model, x)
        np.testing.assert_allclose(ya, ref_dropout(keys[2 * step], x, 0.5)[0])
        np.testing.assert_allclose(yb, ref_dropout(keys[2 * step + 1], x, 0.5)[0])


def test_one_rng_object_in_two_places_is_two_streams():
    """Undeclared, the same Rng object at two places is two streams from one key (as
    the same layer at two places is two layers in Equinox), in every way of running."""

    class Two(eqx.Module):
        a: es.nn.Rng
        b: es.nn.Rng

        def __call__(self):
            return self.a(), self.b()

    keys, _ = ref_keys(jax.random.key(5), 2)
    for run in (
        lambda m: es.apply(lambda m: m(), m),
        eqx.filter_jit(lambda m: es.apply(lambda m: m(), m)),
        es.make_apply(lambda m: m()),
    ):
        rng = es.nn.Rng(5)
        model = Two(rng, rng)
        for i in range(2):
            (ka, kb), model = run(model)
            np.testing.assert_array_equal(key_bits(ka), key_bits(keys[i]))
            np.testing.assert_array_equal(key_bits(kb), key_bits(keys[i]))
    rng = es.nn.Rng(5)
    model = es.to_refs(Two(rng, rng))
    ka, kb = model()
    np.testing.assert_array_equal(key_bits(ka), key_bits(keys[0]))
    np.testing.assert_array_equal(key_bits(kb), key_bits(keys[0]))


def solo_run(seed, xs, p):
    drop = es.nn.Dropout(p, key=seed)
    ys = []
    for x in xs:
        y, drop = es.apply(lambda m, x: m(x), drop, x)
        ys.append(np.asarray(y))
    return ys


@pytest.mark.parametrize("mode", MODES)
def test_ensemble_members_have_independent_streams(mode):
    p, n = 0.5, 3
    seeds = jax.random.split(jax.random.key(20), n)
    xs = jax.random.normal(jax.random.key(1), (3, 16))
    ens = eqx.filter_vmap(lambda k: es.nn.Dropout(p, key=k))(seeds)
    assert ens.rng is not None and ens.rng.key.shape == (n, 2)
    ys = []
    if mode == "value":
        run = eqx.filter_jit(
            eqx.filter_vmap(
                lambda m, x: es.apply(lambda m, x: m(x), m, x),
                in_axes=(eqx.if_array(0), None),
            )
        )
        for x in xs:
            y, ens = run(ens, x)
            ys.append(np.asarray(y))
    else:
        ens = es.to_refs(ens)
        # refs are not arrays to Equinox's filters, so vmap the refs explicitly
        dyn, static = eqx.partition(ens, lambda v: isinstance(v, (jax.Array, jax.Ref)))
        run = jax.jit(
            jax.vmap(lambda d, x: eqx.combine(d, static)(x), in_axes=(0, None))
        )
        for x in xs:
            ys.append(np.asarray(run(dyn, x)))
    for j in range(n):
        solo = solo_run(seeds[j], xs, p)
        for step in range(len(xs)):
            np.testing.assert_array_equal(ys[step][j], solo[step])
    for step in range(len(xs)):
        masks = [ys[step][j] != 0 for j in range(n)]
        assert not np.array_equal(masks[0], masks[1])
        assert not np.array_equal(masks[1], masks[2])


@pytest.mark.parametrize("mode", MODES)
def test_per_example_vmap_with_one_stream_raises(mode):
    drop = as_mode(es.nn.Dropout(0.5, key=0), mode)
    x = jnp.ones((3, 4))
    with pytest.raises(es.StateWriteError, match="call the layer on the whole batch"):
        es.apply(lambda m, x: jax.vmap(m)(x), drop, x)
    # the fix: call it on the batch; every row gets its own mask
    y, _ = es.apply(lambda m, x: m(x), drop, jnp.ones((8, 64)))
    masks = np.asarray(y) != 0
    assert len({m.tobytes() for m in masks}) == 8


def test_dropout_in_sequential_under_jit_and_remat():
    """Inside eqx.nn.Sequential (which passes key=None), jitted and rematerialised:
    the stream advances exactly once per call."""
    seq = eqx.nn.Sequential(
        [eqx.nn.Linear(3, 16, key=jax.random.key(0)), es.nn.Dropout(0.5, key=5)]
    )
    x = jnp.ones(3)

    def loss(seq, x):
        return jnp.sum(eqx.filter_checkpoint(lambda s, x: s(x))(seq, x) ** 2), seq(x)

    step = es.make_step(loss, optax.sgd(0.0), has_aux=True)
    opt_state = step.init(seq)
    keys, last = ref_keys(jax.random.key(5), 4)
    for i in range(2):
        h = seq.layers[0](x)  # before the step consumes `seq`
        seq, opt_state, y = step(seq, opt_state, x)
        # the checkpointed call draws keys[2i], the plain one keys[2i+1]
        np.testing.assert_allclose(
            y, ref_dropout(keys[2 * i + 1], h, 0.5)[0], rtol=1e-6
        )
    np.testing.assert_array_equal(key_bits(seq.layers[1].rng.key[...]), key_bits(last))


def test_remat_gradient_uses_the_forward_mask():
    """Under `eqx.filter_checkpoint` + grad the recomputed forward must not draw a
    new key: the gradient is the forward's mask / (1 - p), and the stream advances
    once per call."""
    p = 0.5
    drop = es.nn.Dropout(p, key=3)
    x = jnp.ones(32)

    def f(x, drop):
        def inner(m, x):
            y = eqx.filter_checkpoint(lambda m, x: m(x))(m, x)
            z = m(x)  # a second draw after the checkpointed one
            return jnp.sum(y), (y, z)

        (loss, aux), drop = es.apply(inner, drop, x)
        return loss, (aux, drop.rng.key[...])

    keys, last = ref_keys(jax.random.key(3), 2)
    for fn in [jax.grad(f, has_aux=True), eqx.filter_jit(jax.grad(f, has_aux=True))]:
        g, ((y, z), key) = fn(x, drop)
        want_y, keep = ref_dropout(keys[0], x, p)
        np.testing.assert_allclose(y, want_y, rtol=1e-6)
        np.testing.assert_allclose(z, ref_dropout(keys[1], x, p)[0], rtol=1e-6)
        np.testing.assert_allclose(g, np.where(keep, 1 / (1 - p), 0.0), rtol=1e-6)
        np.testing.assert_array_equal(key_bits(key), key_bits(last))


@pytest.mark.parametrize("mode", MODES)
def test_per_example_es_vmap_with_axis_name(mode):
    """Per-example calls under `es.vmap(..., axis_name=...)`: example i's mask comes
    from `fold_in(key, i)`, and the stream advances once per call."""
    p, n, f = 0.5, 6, 32
    drop = as_mode(es.nn.Dropout(p, key=9, axis_name="batch"), mode)
    x = jax.random.normal(jax.random.key(0), (n, f))

    def per_example(m, x):
        return es.vmap(m, axis_name="batch")(x)

    run = eqx.filter_jit(lambda m, x: call(m, mode, per_example, x))
    keys, last = ref_keys(jax.random.key(9), 2)
    for step in range(2):
        y, drop = run(drop, x)
        y = np.asarray(y)
        for i in range(n):
            want, _ = ref_dropout(jax.random.fold_in(keys[step], i), x[i], p)
            np.testing.assert_allclose(y[i], want, rtol=1e-6)
        assert len({(row != 0).tobytes() for row in y}) == n
    np.testing.assert_array_equal(key_bits(drop.rng.key[...]), key_bits(last))


@pytest.mark.parametrize("mode", MODES)
def test_save_load_resumes_the_stream(mode, tmp_path):
    rng = as_mode(es.nn.Rng(jax.random.key(21)), mode)
    for _ in range(2):
        _, rng = draw(rng, mode)
    es.save(tmp_path / "rng.eqx", rng)
    resumed = as_mode(es.load(tmp_path / "rng.eqx", es.nn.Rng(0)), mode)
    assert resumed.impl == "threefry2x32"
    for _ in range(2):
        a, rng = draw(rng, mode)
        b, resumed = draw(resumed, mode)
        np.testing.assert_array_equal(key_bits(a), key_bits(b))
    want, _ = ref_keys(jax.random.key(21), 4)
    np.testing.assert_array_equal(key_bits(b), key_bits(want[3]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("p", [0.1, 0.3])
@pytest.mark.split
def test_kept_values_equal_torchs_in_every_float_dtype(dtype, p):
    """PyTorch keeps `x * (1 / (1 - p))` with the scale rounded to the input's dtype;
    in float16 the kept value of 1 at p = 0.3 was 1.4277 here against torch's
    1.4287 (the scale was divided by after rounding `1 - p`)."""
    import torch

    xs = jnp.linspace(0.5, 4.0, 64).astype(dtype)
    y, _ = es.apply(lambda m, x: m(x), es.nn.Dropout(p, key=jax.random.key(0)), xs)
    kept = np.asarray(y.astype(jnp.float32)) != 0
    assert 0 < kept.sum() < xs.size
    t_dtype = getattr(torch, dtype)
    tx = torch.from_numpy(np.array(xs.astype(jnp.float32))).to(t_dtype)
    torch.manual_seed(0)
    ty = torch.nn.functional.dropout(tx, p, True)  # its own mask, torch's values
    t_kept = ty != 0
    want = (tx * torch.tensor(1 / (1 - p)).to(t_dtype)).float().numpy()
    np.testing.assert_array_equal(ty[t_kept].float().numpy(), want[t_kept.numpy()])
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32))[kept], want[kept])


@pytest.mark.parametrize("p", [0.5, 1.0])
def test_nan_and_inf_propagate_through_dropped_entries_as_in_torch(p):
    """PyTorch multiplies by the mask, so a dropped NaN or Inf is NaN (`inf * 0`):
    a diverged activation stays visible. Here a dropped entry was 0, and `p=1`
    gave zeros whatever `x` held."""
    import torch

    x = np.array([np.nan, np.inf, 1.0, -np.inf, -2.0] * 8, np.float32)
    drop = es.nn.Dropout(p, key=jax.random.key(0))
    y, _ = es.apply(lambda m, x: m(x), drop, jnp.asarray(x))
    y = np.asarray(y)
    torch.manual_seed(0)
    t = torch.nn.functional.dropout(torch.from_numpy(x), p, training=True).numpy()
    finite = np.isfinite(x)
    for out in (y, t):  # non-finite exactly where the input is
        np.testing.assert_array_equal(np.isfinite(out), finite)
    # the mask: the same layer (same stream) on ones
    ones, _ = es.apply(lambda m, x: m(x), drop, jnp.ones_like(x))
    kept = np.asarray(ones) != 0
    # torch's rule on this layer's mask: `x * scale` kept, `x * 0` dropped
    with np.errstate(invalid="ignore"):  # inf * 0
        want = np.where(kept, x * np.float32(1 / (1 - p)) if p < 1 else 0, x * 0)
    np.testing.assert_array_equal(y, want)
    if p == 1.0:  # no mask: torch's output itself, signed zeros too
        np.testing.assert_array_equal(y, t)
        assert np.array_equal(np.signbit(y[finite]), np.signbit(t[finite]))
