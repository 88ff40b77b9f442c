"""The tasks of the accuracy benches (bench/accuracy.py; bench/vllm_e2e.py's needle phase): RULER-style
prompts generated with the model's own tokenizer and filled to a target length, and their scoring.
bench/accuracy.py's docstring describes each task. Plain Python beside the tokenizer: no torch."""

from __future__ import annotations

import functools
import random
import re
import string
from collections import Counter
from pathlib import Path

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe", "essay_qa")
# essay_qa: the expected words per question, each at least this long.
ESSAY_QA_WORDS = 4
ESSAY_QA_MIN_WORD = 5


_FILLER_WORDS = {
    "subject": ("The old bridge", "A quiet river", "The night train", "Our small garden", "The city library",
                "A distant mountain", "The morning market", "An open window", "The winter field", "A long road"),
    "verb": ("stood near", "ran past", "looked over", "waited beside", "turned toward", "rested under",
             "shone above", "moved along", "faded behind", "opened onto"),
    "object": ("the harbour", "a row of trees", "the empty square", "the northern hills", "a stone wall",
               "the painted door", "a field of wheat", "the sleeping town", "the wide valley", "a narrow lane"),
    "tail": ("in the evening", "before the rain", "as the bells rang", "while people talked", "for many years",
             "under a grey sky", "after the storm", "in early spring", "without a sound", "at first light"),
}


def filler_sentences(count: int, seed: int) -> list[str]:
    """Synthetic haystack: plain sentences from a small grammar (no facts a question could need)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_FILLER_WORDS[part]) for part in ("subject", "verb", "object", "tail")) + "."
            for _ in range(count)]


def haystack_sentences(text_dir: str | None, seed: int = 0) -> list[str]:
    """Sentences of every ``*.txt`` file of ``text_dir`` (name order), or synthetic filler."""
    if text_dir:
        files = sorted(Path(text_dir).glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"no .txt files in {text_dir}")
        text = " ".join(f.read_text(errors="replace") for f in files)
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s.strip()]
        if sentences:
            return sentences
    return filler_sentences(4000, seed)


def haystack_token_ids(tokenizer, text_dir: str | None, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of haystack text, starting at a seed-chosen sentence (the text repeats when short)."""
    sentences = haystack_sentences(text_dir, seed)
    start = random.Random(seed).randrange(len(sentences))
    ids: list[int] = []
    i = start
    while len(ids) < n:
        chunk = " ".join(sentences[(i + j) % len(sentences)] for j in range(64))
        ids += tokenizer.encode(" " + chunk, add_special_tokens=False)
        i += 64
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return (bos + ids)[:n]


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------

_KEY_WORDS = ("amber", "brisk", "cobalt", "dusky", "ember", "fable", "gusty", "hazel", "ivory", "jolly", "karma",
              "lunar", "mossy", "noble", "olive", "pearl", "quill", "rusty", "sable", "tidal", "umber", "vivid",
              "wispy", "zesty")
_KEY_NOUNS = ("falcon", "harbor", "lantern", "meadow", "orchard", "pebble", "quarry", "saddle", "thimble",
              "violet", "willow", "canyon", "dagger", "beacon", "garnet", "kettle")


def _key(rng) -> str:
    return f"{rng.choice(_KEY_WORDS)}-{rng.choice(_KEY_NOUNS)}"


def _number(rng) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def distinct_keys(rng, count: int) -> list[str]:
    """``count`` different needle keys."""
    keys = [_key(rng)]
    while len(keys) < count:
        candidate = _key(rng)
        if candidate not in keys:
            keys.append(candidate)
    return keys


def planted_needles(rng, count: int) -> list[tuple[str, str, str]]:
    """``count`` magic-number needles of different keys: ``(key, value, sentence)``."""
    return [(key, value, _needle(key, value)) for key in distinct_keys(rng, count) for value in [_number(rng)]]


def magic_number_question(key: str) -> tuple[str, str]:
    """The question about ``key``'s magic number and the answer's first words (niah_single, niah_multikey)."""
    return (f"What is the special magic number for {key} mentioned in the text above?",
            f"The special magic number for {key} mentioned in the text is:")


NIAH_INTRO = ("A few special magic numbers are hidden in the text below. Remember them: there will be "
              "a question about them at the end.")


def make_task(task: str, rng: random.Random):
    """``(intro, needles, question, answer_prefix, answers, items)``: needles are inserted at random
    depths of the haystack; ``items`` replaces the haystack (the word list of cwe) when not None."""
    if task in ("niah_single", "niah_multikey", "niah_multivalue"):
        keys = distinct_keys(rng, 4 if task == "niah_multikey" else 1)
        if task == "niah_multivalue":
            values = [_number(rng) for _ in range(4)]
            needles = [_needle(keys[0], v) for v in values]
            answers = values
        else:
            values = [_number(rng) for _ in keys]
            needles = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
            answers = [values[0]]
        rng.shuffle(needles)
        target = keys[0]
        if task == "niah_multivalue":
            question = f"What are all the special magic numbers for {target} mentioned in the text above?"
            prefix = f"The special magic numbers for {target} mentioned in the text are:"
        else:
            question, prefix = magic_number_question(target)
        return NIAH_INTRO, needles, question, prefix, answers, None
    if task == "vt":
        names = []
        while len(names) < 5:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randrange(10_000, 100_000))
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        intro = "Memorize the variable assignments in the text below and follow them to the end."
        question = (f"Which variables are assigned the value {value}, directly or through other variables, "
                    "in the text above?")
        prefix = f"Following the chain of assignments, the variables that hold the value {value} are:"
        return intro, needles, question, prefix, names, None
    if task == "cwe":
        vocab = sorted({w.lower() for part in _FILLER_WORDS.values() for phrase in part for w in phrase.split()
                        if len(w) > 3} | set(_KEY_NOUNS) | set(_KEY_WORDS))
        rng.shuffle(vocab)
        common, rare = vocab[:10], vocab[10:]
        intro = "Below is a numbered list of words. Some words appear far more often than the others."
        question = "What are the 10 most common words in the list above?"
        prefix = "The 10 most common words in the list are:"
        return intro, [], question, prefix, common, (common, rare)
    if task == "essay_qa":  # the question and answers depend on the haystack: essay_question()
        intro = "Read the text below carefully: there will be a question about its exact wording at the end."
        prefix = "The sentence that comes right after it in the text is:"
        return intro, [], None, prefix, None, None
    raise ValueError(f"unknown task {task!r}; choose from {TASKS}")


class NothingToAsk(ValueError):
    """essay_qa: no sentence of the haystack qualifies for the question (a longer one may hold one)."""


def _words(sentence: str) -> list[str]:
    return re.findall(r"[a-z]+", sentence.lower())


def essay_question(hay: list[str], depth: float) -> tuple[str, list[str]]:
    """``(question, answers)`` over the haystack sentences ``hay``: the sentence nearest ``depth`` (a
    fraction of the haystack) that occurs once in it, has at least 8 words and is followed by a
    sentence of at most 30 words (a quote that fits --max-new-tokens) with ESSAY_QA_WORDS words of
    ESSAY_QA_MIN_WORD letters or more that it lacks itself; the answers are the longest of those
    words (earliest first among equals), so that quoting the following sentence scores 1 and echoing
    the quoted one scores 0."""
    seen = Counter(hay)

    def answer_words(i: int) -> list[str]:
        quoted = set(_words(hay[i]))
        fresh = list(dict.fromkeys(w for w in _words(hay[i + 1]) if len(w) >= ESSAY_QA_MIN_WORD and w not in quoted))
        return sorted(fresh, key=lambda w: -len(w))[:ESSAY_QA_WORDS]

    candidates = [i for i in range(len(hay) - 1)
                  if seen[hay[i]] == 1 and len(hay[i].split()) >= 8 and len(hay[i + 1].split()) <= 30
                  and len(answer_words(i)) == ESSAY_QA_WORDS]
    if not candidates:
        raise NothingToAsk(f"essay_qa: no sentence of a {len(hay)}-sentence haystack can be asked about")
    target = min(candidates, key=lambda i: (abs(i - depth * (len(hay) - 1)), i))
    question = (f'In the text above, which sentence comes right after this one: "{hay[target]}" '
                "Quote that sentence.")
    return question, answer_words(target)


def _cwe_items(common, rare, count: int, rng: random.Random) -> list[str]:
    """A word list of ``count`` entries where each common word appears 30 times per 100 rare ones."""
    words = []
    while len(words) < count:
        block = [w for w in common for _ in range(3)] + [rng.choice(rare) for _ in range(10)]
        rng.shuffle(block)
        words += block
    return [f"{i + 1}. {w}" for i, w in enumerate(words[:count])]


def build_prompt(tokenizer, task: str, n: int, seed: int, sentences: list[str],
                 count: int | None = None) -> tuple[list[int], list[str], int]:
    """Token ids of one sample of ``task`` filled to at most ``n`` tokens, its expected answers, and
    the haystack's sentence (or item) count that fills it. ``count``: that count as an earlier run
    of the same configuration found it, rendered once instead of searched for again (the search
    tokenizes the whole prompt about 19 times: about a second at 32K tokens); a count that no longer
    fits is searched for."""
    rng = random.Random(f"{task}:{n}:{seed}")
    intro, needles, question, prefix, answers, items = make_task(task, rng)
    depths = sorted(rng.random() for _ in needles)
    start = rng.randrange(len(sentences))
    question_depth = rng.random()  # essay_qa: where the quoted sentence lies

    def haystack(count: int) -> list[str]:
        return [sentences[(start + i) % len(sentences)] for i in range(count)]

    @functools.cache  # rendered and then asked for its answers
    def question_and_answers(count: int) -> tuple[str, list[str]]:
        return essay_question(haystack(count), question_depth) if task == "essay_qa" else (question, answers)

    @functools.cache  # the search's last fitting count is rendered again as the result
    def render(count: int) -> list[int]:
        asked = question_and_answers(count)[0]
        if items is not None:
            body = "\n".join(_cwe_items(*items, count, random.Random(seed)))
        else:
            hay = haystack(count)
            for depth, needle in reversed(list(zip(depths, needles, strict=True))):
                hay.insert(int(round(depth * count)), needle)
            body = " ".join(hay)
        user = f"{intro}\n\n{body}\n\n{asked}"
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)
            return tokenizer.encode(text + prefix, add_special_tokens=False)
        return tokenizer.encode(f"{user}\n{prefix}", add_special_tokens=True)

    if count is not None:
        ids = render(count)
        if len(ids) <= n:
            return ids, question_and_answers(count)[1], count

    def fits(count: int) -> bool:
        try:
            return len(render(count)) <= n
        except NothingToAsk:  # a longer haystack may hold a sentence to ask about
            if count >= n:  # every sentence is a token at least: no longer haystack would fit
                raise
            return True

    # Grow the haystack geometrically to the length, then bisect for the largest that fits.
    low, high = 0, 16
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return render(low), question_and_answers(low)[1], low


def score_answer(text: str, answers: list[str]) -> float:
    """Share of the expected strings present in the answer (case-insensitive)."""
    text = text.lower()
    return sum(a.lower() in text for a in answers) / len(answers)
