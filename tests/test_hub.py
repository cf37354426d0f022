"""Model names, the conversion cache and its corruption checks, and loading from safetensors."""

import pytest
import torch

from bitune import hub, store
from bitune.errors import BituneError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BITUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_folder(tmp_path):
    """A tiny random Llama saved with save_pretrained, with a word-level tokenizer that has no pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "Question:", "Answer:", "hi", "there"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _fake_converted(cache, name="smollm2-135m"):
    folder = cache / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    store.write_manifest(folder, name=name)
    return folder


def test_list_models_default_first():
    names = list(hub.list_models())
    assert names[0] == hub.DEFAULT_MODEL == "smollm2-135m"
    assert set(names) == {"smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"}


def test_resolve_passes_folders_and_hub_ids(tiny_folder, cache, monkeypatch):
    import huggingface_hub

    assert hub.resolve_model(str(tiny_folder)) == str(tiny_folder)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda name, timeout: None)  # the hub answers: it exists
    assert hub.resolve_model("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"

    def unreachable(name, timeout):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)  # no retries: one failed request, one error
    with pytest.raises(BituneError, match="cannot be reached"):
        hub.resolve_model("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(BituneError, match="does not exist.*smollm2-135m"):
        hub.resolve_model("./no/such/folder")
    with pytest.raises(BituneError, match="did you mean the built-in 'smollm2-135m'"):
        hub.resolve_model("smollm2-13m")


def test_resolve_reuses_verified_cache(cache):
    folder = _fake_converted(cache)
    assert hub.resolve_model("smollm2-135m") == str(folder)
    assert hub.model_dir("smollm2-135m") == folder


def test_corrupt_cache_is_detected(cache):
    folder = _fake_converted(cache)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"weightz" * 100)  # same size, different bytes
    with pytest.raises(BituneError, match="model.safetensors is missing or modified.*delete the folder"):
        hub.resolve_model("smollm2-135m")
    weights.unlink()
    with pytest.raises(BituneError, match="missing or modified"):
        hub.resolve_model("smollm2-135m")


def test_half_written_cache_is_detected(cache):
    folder = _fake_converted(cache)
    (folder / store.MANIFEST).unlink()
    with pytest.raises(BituneError, match="incomplete or corrupt.*delete the folder"):
        hub.resolve_model("smollm2-135m")


def test_failed_conversion_leaves_nothing(cache, monkeypatch):
    def fail(spec, work):
        (work / "partial.gguf").write_bytes(b"x")
        raise BituneError("download failed")

    monkeypatch.setattr(hub, "_assemble_gguf", fail)
    with pytest.raises(BituneError, match="download failed"):
        hub.resolve_model("gemma3-270m")
    assert not hub.model_dir("gemma3-270m").exists()
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".tmp")]


def test_load_model_from_folder(tiny_folder):
    model, tokenizer = hub.load_model(str(tiny_folder), dtype="bfloat16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert tokenizer.padding_side == "left"


def test_load_model_refuses_pickle_weights(tmp_path, tiny_folder):
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (pickled / name).write_bytes((tiny_folder / name).read_bytes())
    torch.save(load_file(tiny_folder / "model.safetensors"), pickled / "pytorch_model.bin")
    with pytest.raises(BituneError, match="not a built-in .*smollm2-135m.*safetensors"):
        hub.load_model(str(pickled))


def test_bad_dtype(tiny_folder):
    with pytest.raises(BituneError, match="unknown dtype"):
        hub.load_model(str(tiny_folder), dtype="float33")


def _greedy(model, tokenizer, prompt, n=12):
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "prompt", "expected"),
    [
        ("smollm2-135m", "The capital of France is", "Paris"),
        ("gemma3-270m", "Question: What is the capital of France?\n\nAnswer:", "Paris"),  # a base model
        ("qwen2.5-0.5b", "def fibonacci(n):", "return"),
    ],
)
def test_builtin_model_converts_and_generates(name, prompt, expected):
    model, tokenizer = hub.load_model(name)
    assert hub.resolve_model(name) == str(hub.model_dir(name))
    manifest = store.verify_manifest(hub.model_dir(name))
    assert manifest["gguf_sha256"] == hub.BUILTIN_MODELS[name].sha256
    assert expected in _greedy(model, tokenizer, prompt)
