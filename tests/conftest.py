import sys
from pathlib import Path

import pytest
import torch

from helpers import require_transformers


def _hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if _hopper_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ops():
    """torch.ops.cosa, failing (not skipping) when the extension was not built: a missing build is a bug."""
    import cosa

    if not cosa._C_AVAILABLE:
        pytest.fail(f"cosa._C is not importable ({cosa._C_IMPORT_ERROR}); install the package first (README)")
    return torch.ops.cosa


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Llama with random weights and a word-level tokenizer built here (no download)."""
    require_transformers()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import accuracy_tasks
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = {w for part in accuracy_tasks._FILLER_WORDS.values() for phrase in part for w in phrase.split()}
    words |= set(accuracy_tasks._KEY_WORDS) | set(accuracy_tasks._KEY_NOUNS) | set(accuracy_tasks.NIAH_INTRO.split())
    vocab = ["<unk>", "<s>", "</s>"] + sorted(words) + list("0123456789.,:?-=") + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    vocab = {w: i for i, w in enumerate(dict.fromkeys(vocab))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.Split(Regex("[A-Z]"), "isolated")])
    tok.decoder = decoders.WordPiece(prefix="##")
    folder = tmp_path_factory.mktemp("tiny-llama")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(vocab), max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
