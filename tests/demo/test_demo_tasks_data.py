"""The demo model's data (moeserve.demo.tasks), without a model: the held-out tasks are pinned
(the same tasks whatever the training mix), training cities mix real, spliced and made-up names
and never a held-out one, and the training stream is deterministic for a seed. Standard library
only; a second or two."""

import hashlib
import json
import random
from collections import Counter

from moeserve.demo import tasks

# These digests pin the held-out set: held_out_tasks(50) (their prompts, and their expected
# replies), held_out_text(20) and the held-out synthetic names, as computed on main before the
# spliced training names (commit 15c4a77). They keep evaluations comparable across retrained
# models: a change to the training data (the mix of city names, ...) must not change them. If a
# change of the chat format (render_chat) moves the prompt digest only, re-pin it knowingly; if
# the tasks themselves change, every number measured on them before is no longer comparable.
HELD_OUT_TASKS_50_PROMPTS = "dc6e8b22b3d534d19f8a97265bf641090c626edebc39e4612af5c6099c30c12d"
HELD_OUT_TASKS_50_FULL = "93f9dfe2d508c5d467fec8a6d9227ab9bf334962475db55d7e8f1cd55673a694"
HELD_OUT_TEXT_20_FULL = "f5fd8e35987a66f6887bc6b021475a7dea896e15cf3ac238fd91ef6c969e3a56"
HELD_OUT_SYNTHETIC = "93c2d45e39e62f4c6d5a0272e0e9fbd88f6d75ff730193d9d66defa842ef2763"


def _digest(samples, full: bool) -> str:
    h = hashlib.sha256()
    for s in samples:
        item = [s.prompt(), s.completion(), s.kind, s.expect] if full else [s.prompt()]
        h.update(json.dumps(item, ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def test_held_out_set_is_pinned():
    held = tasks.held_out_tasks(50)
    assert _digest(held, full=False) == HELD_OUT_TASKS_50_PROMPTS
    assert _digest(held, full=True) == HELD_OUT_TASKS_50_FULL
    assert _digest(tasks.held_out_text(20), full=True) == HELD_OUT_TEXT_20_FULL
    assert len(tasks.HELD_OUT_SYNTHETIC) == 399
    assert hashlib.sha256("\n".join(tasks.HELD_OUT_SYNTHETIC).encode()).hexdigest() == HELD_OUT_SYNTHETIC
    # the earlier turns of held-out samples are about training cities: in the pinned mix, not the
    # current one, so that no spliced name (nor a change of the mix) reaches them
    assert any(len([m for m in s.messages if m["role"] == "user"]) > 1 for s in held)


_PREFIXES = {c[:i].strip() for c in tasks.TRAIN_CITIES for i in range(1, len(c))}
_WORD_TAILS = {c[j].lower() + c[j + 1 :] for c in tasks.TRAIN_CITIES for j in range(1, len(c)) if c[j] != " "}
_SPACE_TAILS = {t[0].upper() + t[1:] for c in tasks.TRAIN_CITIES for j in range(1, len(c)) if (t := c[j:].strip())}


def _is_splice(name: str) -> bool:
    """Whether ``name`` is a training city's head joined to another's tail, as spliced_city joins."""
    for k in range(1, len(name)):
        if name[:k] in _PREFIXES and name[k] != " " and name[k:] in _WORD_TAILS:
            return True
        if name[k] == " " and name[:k] in _PREFIXES and name[k + 1 :] in _SPACE_TAILS:
            return True
    return False


def _training_city_args(samples) -> list[str]:
    calls = [c for s in samples for m in s.messages + [s.target] for c in m.get("tool_calls", [])]
    return [a["city"] for c in calls if "city" in (a := json.loads(c["function"]["arguments"]))]


def test_spliced_city_joins_two_training_names():
    rng = random.Random(0)
    names = [tasks.spliced_city(rng) for _ in range(3000)]
    assert names == [tasks.spliced_city(r) for r in [random.Random(0)] for _ in range(3000)]  # seeded
    assert all(_is_splice(n) for n in names)
    assert all(n[0].isupper() and n == " ".join(n.split()) for n in names)  # a name: capitalised, single spaces
    held = {c.casefold() for c in tasks.HELD_OUT_CITIES + list(tasks.HELD_OUT_SYNTHETIC)}
    assert not [n for n in names if n.casefold() in held]
    assert not [n for n in names if any(c.casefold() in n.casefold() for c in tasks.HELD_OUT_CITIES)]
    assert len(set(names)) > 2500  # mostly new names, not a few recurring ones


def test_training_cities_mix_real_spliced_and_synthetic():
    rng = random.Random(1)
    names = [tasks._city(rng, held_out=False) for _ in range(4000)]
    train = set(tasks.TRAIN_CITIES)
    kinds = Counter("train" if n in train else "spliced" if _is_splice(n) else "synthetic" for n in names)
    share = {k: v / len(names) for k, v in kinds.items()}
    # 30 / 25 / 45 %; about one synthetic name in twenty also parses as a splice (27.5 / 42.5 %)
    assert 0.27 < share["train"] < 0.33, share
    assert 0.23 < share["spliced"] < 0.31, share
    assert 0.38 < share["synthetic"] < 0.47, share


def test_training_samples_hold_spliced_names_and_never_held_out_ones():
    samples = tasks.training_samples(0, 600)
    cities = _training_city_args(samples)
    train = set(tasks.TRAIN_CITIES)
    spliced = [c for c in cities if c not in train and _is_splice(c)]
    assert len(spliced) > 0.15 * len(cities), (len(spliced), len(cities))
    held = set(tasks.HELD_OUT_CITIES) | set(tasks.HELD_OUT_SYNTHETIC)
    assert not [c for c in cities if c in held]
    text = " ".join(s.prompt() + s.completion() for s in samples)
    assert not [c for c in tasks.HELD_OUT_CITIES if c in text]


def test_training_samples_are_deterministic_for_a_seed():
    def texts(samples):
        return [(s.prompt(), s.completion(), s.kind) for s in samples]

    first = texts(tasks.training_samples(7, 40))
    assert first == texts(tasks.training_samples(7, 40))
    assert first[25:] == texts(tasks.training_samples(7, 15, start=25))  # any slice on its own
    assert first != texts(tasks.training_samples(8, 40))
    assert _training_city_args(tasks.training_samples(7, 40)) == _training_city_args(tasks.training_samples(7, 40))
