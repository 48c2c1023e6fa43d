"""Corrupt, truncated and malformed checkpoints: every one raises `CheckpointError`
(never another exception, never different values).

Two fuzzers over a small file: a flip of every bit (caught by the whole-file
SHA-256), and a flip of every header bit *with the checksum recomputed* (what a buggy
writer or a hand-edited file looks like), which must be caught by the header
validation or the comparison with `like`. Then hypothesis on arbitrary bytes and
arbitrary JSON headers, and the malformed files a red-team pass reported."""

import hashlib
import io
import json
import struct

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _checkpoint_helpers import assert_tree_exact
from hypothesis import given, settings

import eqx_state as es


def small_tree():
    return {
        "w": jnp.array([1.5, -2.0], jnp.float32),
        "k": jax.random.key(7),
        "n": np.int64(2**40 + 1),
        "p": 0.25,
    }


def saved_bytes(tree=None):
    buffer = io.BytesIO()
    es.save(buffer, small_tree() if tree is None else tree)
    return buffer.getvalue()


def split(blob):
    """(version, header bytes, payload, digest) of a file."""
    version, n = struct.unpack_from("<IQ", blob, 8)
    return version, blob[20 : 20 + n], blob[20 + n : -32], blob[-32:]


def signed(header: bytes, payload: bytes, version: int = 2) -> bytes:
    body = b"EQXSTATE" + struct.pack("<IQ", version, len(header)) + header + payload
    return body + hashlib.sha256(body).digest()


def header_of(blob):
    return json.loads(split(blob)[1])


def with_header(blob, header_obj):
    _, _, payload, _ = split(blob)
    return signed(json.dumps(header_obj).encode(), payload)


def load_bytes(blob, like=None):
    return es.load(io.BytesIO(blob), like=small_tree() if like is None else like)


def test_the_small_file_round_trips():
    blob = saved_bytes()
    assert len(blob) < 600  # keeps the sweeps below fast
    assert_tree_exact(load_bytes(blob), small_tree())


def test_every_single_bit_flip_is_detected():
    blob = saved_bytes()
    for i in range(len(blob)):
        for bit in range(8):
            bad = bytearray(blob)
            bad[i] ^= 1 << bit
            with pytest.raises(es.CheckpointError):
                load_bytes(bytes(bad))


def test_every_truncation_is_detected():
    blob = saved_bytes()
    for n in range(len(blob)):
        with pytest.raises(es.CheckpointError):
            load_bytes(blob[:n])
    with pytest.raises(es.CheckpointError):
        load_bytes(blob + b"\0")


def test_header_bit_flips_with_a_valid_checksum():
    """Flip every bit of the header and recompute the checksum: load must return
    exactly the saved values or raise `CheckpointError`, nothing else."""
    blob = saved_bytes()
    _, header, payload, _ = split(blob)
    want = small_tree()
    outcomes = {"error": 0, "same": 0}
    for i in range(len(header)):
        for bit in range(8):
            bad = bytearray(header)
            bad[i] ^= 1 << bit
            try:
                got = load_bytes(signed(bytes(bad), payload))
            except es.CheckpointError:
                outcomes["error"] += 1
            else:
                assert_tree_exact(got, want)
                outcomes["same"] += 1
    assert outcomes["error"] > 0.9 * 8 * len(header)


def test_every_header_length_and_version_is_handled():
    blob = saved_bytes()
    version, header, payload, _ = split(blob)
    for bit in range(64):  # header length fields that lie, re-signed
        n = len(header) ^ (1 << bit)
        body = b"EQXSTATE" + struct.pack("<IQ", version, n) + header + payload
        with pytest.raises(es.CheckpointError):
            load_bytes(body + hashlib.sha256(body).digest())
    for v in (0, 1, 3, 2**32 - 1):
        with pytest.raises(es.CheckpointError, match=f"format version {v};"):
            load_bytes(signed(header, payload, version=v))
    # a bit flipped in the version field of a version-2 file is corruption (the
    # checksum says so), not a file of another version
    for bit in range(32):
        body = b"EQXSTATE" + struct.pack("<IQ", 2 ^ (1 << bit), len(header))
        with pytest.raises(es.CheckpointError, match="corrupt.*version field reads"):
            load_bytes(body + header + payload + split(blob)[3])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(data):
    for blob in (data, b"EQXSTATE" + data, signed(data, b"")):
        with pytest.raises(es.CheckpointError):
            load_bytes(blob)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "path",
                    "kind",
                    "dtype",
                    "shape",
                    "weak_type",
                    "ref",
                    "key_impl",
                    "python_type",
                    "entries",
                    "x",
                ]
            ),
            inner,
            max_size=6,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_arbitrary_json_headers(header):
    blob = saved_bytes()
    _, _, payload, _ = split(blob)
    for obj in (header, {"entries": header}, {"entries": [header]}):
        try:
            text = json.dumps(obj).encode()
        except ValueError:
            continue
        with pytest.raises(es.CheckpointError):
            load_bytes(signed(text, payload))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_entries(data):
    """Change one field of one entry of a real header to another JSON value: exactly
    the saved values (the value was equivalent) or `CheckpointError`."""
    blob = saved_bytes()
    header = header_of(blob)
    entry = data.draw(st.sampled_from(header["entries"]))
    field = data.draw(st.sampled_from(sorted(entry) + ["extra"]))
    value = data.draw(
        json_values
        | st.sampled_from(
            [
                "float64",
                "uint32",
                "int32",
                "numpy",
                "jax",
                "python",
                "rbg",
                "threefry2x32",
                [],
                [2],
                [1, 2],
            ]
        )
    )
    entry[field] = value
    try:
        got = load_bytes(with_header(blob, header))
    except es.CheckpointError:
        return
    assert_tree_exact(got, small_tree())


def entry_at(header, path):
    return next(e for e in header["entries"] if e["path"] == path)


def malformed():
    """The malformed files a red-team pass found (each re-signed, so only the header
    validation can catch them), and more."""
    blob = saved_bytes()
    _, header_bytes, payload, _ = split(blob)
    cases = {}

    def case(name, fn):
        header = header_of(blob)
        out = fn(header)
        cases[name] = out if isinstance(out, bytes) else with_header(blob, header)

    case("list header", lambda h: signed(b"[]", payload))
    case("string header", lambda h: signed(b'"entries"', payload))
    case("no entries", lambda h: h.pop("entries"))
    case("extra top-level key", lambda h: h.update(sha256="0" * 64))
    case("entries not a list", lambda h: h.update(entries={"a": 1}))
    case("entry not an object", lambda h: h["entries"].append(3))
    case("missing path", lambda h: h["entries"][0].pop("path"))
    case("missing dtype", lambda h: h["entries"][0].pop("dtype"))
    case("missing kind", lambda h: h["entries"][0].pop("kind"))
    case("unknown kind", lambda h: h["entries"][0].update(kind="pickle"))
    case("unknown field", lambda h: h["entries"][0].update(offset=0))
    case("unknown dtype", lambda h: entry_at(h, "['w']").update(dtype="object"))
    case(
        "dtype name with spaces",
        lambda h: entry_at(h, "['w']").update(dtype=" float32"),
    )
    case("wider dtype", lambda h: entry_at(h, "['w']").update(dtype="float64"))
    case(
        "narrower dtype",
        lambda h: entry_at(h, "['w']").update(dtype="float16", shape=[4]),
    )
    case("float dim", lambda h: entry_at(h, "['w']").update(shape=[2.0]))
    case("bool dim", lambda h: entry_at(h, "['w']").update(shape=[True, True]))
    case("negative dim", lambda h: entry_at(h, "['w']").update(shape=[-2]))
    case("huge dim", lambda h: entry_at(h, "['w']").update(shape=[2**62]))
    case("string shape", lambda h: entry_at(h, "['w']").update(shape="2"))
    case("too many dims", lambda h: entry_at(h, "['w']").update(shape=[1] * 65))
    case("reshaped", lambda h: entry_at(h, "['w']").update(shape=[1, 2]))
    case("weak_type not bool", lambda h: entry_at(h, "['w']").update(weak_type=1))
    case(
        "weak bool array",
        lambda h: entry_at(h, "['w']").update(weak_type=True, dtype="bool", shape=[8]),
    )
    case("ref not bool", lambda h: entry_at(h, "['w']").update(ref="yes"))
    case(
        "key_impl on a plain array",
        lambda h: entry_at(h, "['w']").update(key_impl="threefry2x32"),
    )
    case("other key impl", lambda h: entry_at(h, "['k']").update(key_impl="rbg"))
    case(
        "unknown key impl", lambda h: entry_at(h, "['k']").update(key_impl="os.system")
    )
    case("key turned raw", lambda h: entry_at(h, "['k']").pop("key_impl"))
    case("numpy scalar with a shape", lambda h: entry_at(h, "['n']").update(shape=[1]))
    case(
        "numpy scalar to jax",
        lambda h: entry_at(h, "['n']").update(kind="jax", weak_type=False, ref=False),
    )
    case(
        "numpy scalar to numpy array of another shape",
        lambda h: entry_at(h, "['n']").update(kind="numpy", shape=[1]),
    )
    case(
        "python float to int", lambda h: entry_at(h, "['p']").update(python_type="int")
    )
    case(
        "python type unknown", lambda h: entry_at(h, "['p']").update(python_type="str")
    )
    case(
        "python type with wrong dtype",
        lambda h: entry_at(h, "['p']").update(
            dtype="float32", shape=[], python_type="float"
        ),
    )
    case("duplicate entry", lambda h: h["entries"].append(dict(h["entries"][0])))
    case("renamed path", lambda h: entry_at(h, "['w']").update(path="['v']"))
    case("path not a string", lambda h: entry_at(h, "['w']").update(path=["w"]))
    case("dropped entry", lambda h: h["entries"].pop(0))
    case(
        "duplicate JSON key",
        lambda h: signed(
            header_bytes.replace(b'"kind":"jax"', b'"kind":"jax","kind":"jax"', 1),
            payload,
        ),
    )
    case("deep nesting", lambda h: signed(b"[" * 100_000 + b"]" * 100_000, payload))
    case(
        "huge integer literal",
        lambda h: signed(
            header_bytes.replace(b"[2]", b"[" + b"9" * 5000 + b"]", 1), payload
        ),
    )
    case("invalid UTF-8", lambda h: signed(header_bytes + b"\xff", payload))
    case(
        "NaN shape",
        lambda h: signed(header_bytes.replace(b"[2]", b"[NaN]", 1), payload),
    )
    case("payload too long", lambda h: signed(header_bytes, payload + b"\0"))
    case("payload too short", lambda h: signed(header_bytes, payload[:-1]))
    case("empty", lambda h: b"")
    case("magic only", lambda h: b"EQXSTATE")
    case("no digest", lambda h: blob[:-32])
    case("bad digest", lambda h: blob[:-1] + bytes([blob[-1] ^ 1]))
    case("version 1 header", lambda h: blob[:8] + struct.pack("<I", 1) + blob[12:])
    case("pickle", lambda h: b"\x80\x04\x95" + b"\0" * 40)
    return cases


MALFORMED = malformed()


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_files_raise_checkpoint_error(name):
    with pytest.raises(es.CheckpointError, match="<file object>"):
        load_bytes(MALFORMED[name])


def test_a_numpy_scalar_recorded_as_a_0d_array_loads_the_same_value():
    """A NumPy scalar and a 0-d NumPy array are the same data: a header that says
    one where the other was saved loads exactly the saved value, as `like`'s type
    (the rule `es.load` shares with `es.from_orbax`; tests/io/test_orbax.py)."""
    blob = saved_bytes()
    header = header_of(blob)
    entry_at(header, "['n']").update(kind="numpy")
    got = load_bytes(with_header(blob, header))
    assert_tree_exact(got, small_tree())
    assert type(got["n"]) is np.int64 and got["n"] == 2**40 + 1


def test_errors_name_the_first_bad_entry():
    blob = saved_bytes()
    header = header_of(blob)
    entry_at(header, "['w']").update(shape=[-2])
    with pytest.raises(es.CheckpointError, match=r"entry \d \(\['w'\]\) has a 'shape'"):
        load_bytes(with_header(blob, header))
    header = header_of(blob)
    header["entries"].append(dict(header["entries"][1]))
    with pytest.raises(es.CheckpointError, match=r"entry 4 \(.*\) repeats the path"):
        load_bytes(with_header(blob, header))
    header = header_of(blob)
    entry_at(header, "['w']").update(key_impl="threefry2x32")
    with pytest.raises(
        es.CheckpointError, match=r"\(\['w'\]\) is a PRNG key whose data"
    ):
        load_bytes(with_header(blob, header))


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "model.eqxs"
    path.write_bytes(MALFORMED["bad digest"])
    with pytest.raises(
        es.CheckpointError, match=r"model\.eqxs' is truncated or corrupt"
    ):
        es.load(path, like=small_tree())
    with (
        open(path, "rb") as f,
        pytest.raises(es.CheckpointError, match=r"model\.eqxs'"),
    ):
        es.load(f, like=small_tree())


def test_a_raw_key_cell_cannot_become_a_typed_key():
    raw = {"k": jax.random.PRNGKey(1)}
    blob = saved_bytes(raw)
    header = header_of(blob)
    header["entries"][0]["key_impl"] = "threefry2x32"
    with pytest.raises(es.CheckpointError, match=r"typed PRNG key .* uint32\(2,\)"):
        load_bytes(with_header(blob, header), like=raw)
