"""A tiny character-level tokenizer matching the tiny test models' vocabulary (64 ids); and chat tokenizers with
SmolLM2's and Gemma 3's chat templates, a conversation and what each template renders of it."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:?!#\n()-+*/=$QA'"


def tiny_tokenizer(add_bos: bool = True) -> PreTrainedTokenizerFast:
    """Ids: <pad>=0, </s>=1, <s>=2, <unk>=3, then one id per character of ``CHARS`` (all below 64)."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3}
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    assert len(vocab) <= 64
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>")


SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's chat template, as its tokenizer in ~/.cache/bitune holds it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt"
    " %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GEMMA3_TEMPLATE = (  # Gemma 3's chat template (tokenizer_config.json of the gemma-3 models)
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n")

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]
# What each template renders: the prompt (ending with the generation prompt), the answer (ending with the
# end-of-turn token) and what the full rendering writes after it.
RENDERED = {
    "smollm2": (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
        "Rome is the capital of Italy.<|im_end|>", "\n"),
    "gemma3": (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
        "<start_of_turn>model\n",
        "Rome is the capital of Italy.<end_of_turn>", "\n"),
}


def chat_tokenizer(kind: str):
    """A byte-level BPE trained in-process on rendered conversations, with the family's special tokens and chat
    template (SmolLM2: eos is the end-of-turn token; Gemma 3: eos ``<eos>`` differs from ``<end_of_turn>``)."""
    specials = {"smollm2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                "gemma3": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]}[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [prompt + answer + after for prompt, answer, after in RENDERED.values()] + [
        "user assistant system model Hello, what is two plus two? It is four. Why is the sky blue?"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 5, trainer)
    names = ({"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "bos_token": "<|im_start|>"} if kind == "smollm2"
             else {"eos_token": "<eos>", "pad_token": "<pad>", "bos_token": "<bos>"})
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    fast.chat_template = SMOLLM2_TEMPLATE if kind == "smollm2" else GEMMA3_TEMPLATE
    return fast
