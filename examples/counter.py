"""The seed tutorial's counter, as a stateful layer: prints 1, 2, 3 in both modes.

A Python counter under `jax.jit` returns 1 forever (its side effect ran once, at
trace time). With eqx_state the count lives in a state cell inside the model:

* value mode: `es.apply` runs the call purely and returns the new model;
* ref mode: `es.to_refs` makes the cell a `jax.Ref`, written in place by a jitted
  call.
"""

import argparse

import equinox as eqx

import eqx_state as es


def count_value_mode(steps: int) -> list[int]:
    counter = es.nn.Counter()

    @eqx.filter_jit
    def count(counter):
        return es.apply(lambda c: c.increment(), counter)

    seen = []
    for _ in range(steps):
        n, counter = count(counter)
        seen.append(int(n))
    return seen


def count_ref_mode(steps: int) -> list[int]:
    counter = es.to_refs(es.nn.Counter())
    count = eqx.filter_jit(lambda c: c.increment())
    return [int(count(counter)) for _ in range(steps)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print("value mode:")
    for n in count_value_mode(args.steps):
        print(n)
    print("ref mode:")
    for n in count_ref_mode(args.steps):
        print(n)


if __name__ == "__main__":
    main()
