"""Tokenizer folders in the layouts of four model families, written for the tests (nothing is
downloaded): Qwen3, Llama 3, Gemma and Mistral. Each has a byte-level BPE tokenizer.json
with the family's special tokens, the family's files naming them (tokenizer_config.json,
special_tokens_map.json, generation_config.json) and a chat template with the family's
roles and turn markers:

    qwen3    <|im_start|>role\\n...<|im_end|>; a system role; pad <|endoftext|>, no BOS in
             tokenizer_config.json (generation_config.json's bos_token_id); <tool_call> ...
    llama3   <|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>; a
             system role; tokenizer_config.json's eos is <|end_of_text|> (turns end with
             <|eot_id|>); no padding token
    gemma    <bos><start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n; raises on a
             system message; <pad>, <eos> named
    mistral  <s>[INST] ... [/INST] reply</s>; raises on a system message (roles must
             alternate); tokens named in special_tokens_map.json only; no padding token

`EXPECTED[family]` is the prompt "2+2?" as the student sees it at effort "high" with
`effort_format="auto"`, and as the teachers see it.
"""
import json
import os

QWEN3 = (
    "{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in rest %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
    "and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")

LLAMA3 = (
    "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
    "\n\n{% endif %}")

GEMMA = (
    "{{ bos_token }}{% if messages[0].role == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m.role == 'assistant' else m.role %}"
    "<start_of_turn>{{ role }}\n{{ m.content | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

MISTRAL = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m.role == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% else %} {{ m.content | trim }}{{ eos_token }}{% endif %}{% endfor %}")

QWEN_TOOLS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SPECIALS = {
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *QWEN_TOOLS, "<think>",
              "</think>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
    "mistral": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
}
FAMILIES = tuple(SPECIALS)

# (student at effort "high", teacher) of the prompt "2+2?".
EXPECTED = {
    "qwen3": ("<|im_start|>system\nReasoning effort: high<|im_end|>\n"
              "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
              "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
    "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
               "Reasoning effort: high<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
               "2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
               "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "gemma": ("<bos><start_of_turn>user\nReasoning effort: high\n\n2+2?<end_of_turn>\n"
              "<start_of_turn>model\n",
              "<bos><start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"),
    "mistral": ("<s>[INST] Reasoning effort: high\n\n2+2? [/INST]", "<s>[INST] 2+2? [/INST]"),
}
# What each family's files give: (end of response, padding, BOS, where the effort goes).
READ = {
    "qwen3": ("<|im_end|>", "<|endoftext|>", "<|endoftext|>", "system"),
    "llama3": ("<|eot_id|>", "<pad>", "<|begin_of_text|>", "system"),
    "gemma": ("<end_of_turn>", "<pad>", "<bos>", "user"),
    "mistral": ("</s>", "<pad>", "<s>", "user"),
}


def _train(specials, texts, vocab_size):
  import tokenizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=specials,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  return tok


def _write(folder, name, obj):
  with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
    json.dump(obj, f)


def make_family(family: str, folder: str, texts=(), vocab_size: int = 400) -> str:
  """The tokenizer folder of `family` in `folder` (created), its BPE trained on `texts` (and
  a few lines of its own); returns `folder`."""
  specials = SPECIALS[family]
  base = ["the quick brown fox jumps over the lazy dog", "2+2? Reasoning effort: high",
          "def f(x):\n    return x + 1"]
  tok = _train(specials, list(texts) + base * 5, vocab_size)
  os.makedirs(folder, exist_ok=True)
  tok.save(os.path.join(folder, "tokenizer.json"))
  ids = {s: tok.token_to_id(s) for s in specials}
  if family == "qwen3":
    _write(folder, "tokenizer_config.json", {
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": QWEN3})
    _write(folder, "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]})
  elif family == "llama3":
    _write(folder, "tokenizer_config.json", {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "chat_template": LLAMA3})
    _write(folder, "generation_config.json", {
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]})
  elif family == "gemma":
    added = {"__type": "AddedToken", "lstrip": False, "rstrip": False, "normalized": False,
             "single_word": False, "special": True}
    _write(folder, "tokenizer_config.json", {
        "bos_token": dict(added, content="<bos>"), "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "chat_template": GEMMA})
    _write(folder, "generation_config.json", {
        "bos_token_id": ids["<bos>"], "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]})
  else:
    _write(folder, "tokenizer_config.json", {"chat_template": MISTRAL})
    _write(folder, "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>",
                                               "unk_token": "<unk>"})
  return folder
