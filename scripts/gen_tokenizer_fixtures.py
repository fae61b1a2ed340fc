#!/usr/bin/env python3
"""Regenerates the tokenizer and chat-template golden fixtures of flatrun-model.

Development tool only (CI never runs it): it needs the llama.cpp reference CLI
(`oracle`, see the project notes) and a Python with `gguf` and `jinja2`.

    ORACLE=/path/to/oracle python3 scripts/gen_tokenizer_fixtures.py ids
    python3 scripts/gen_tokenizer_fixtures.py chat      # needs gguf + jinja2

`ids`: for every model below and every text in
crates/flatrun-model/tests/fixtures/tokenizer/corpus/*.txt, runs
`oracle tokenize MODEL --text TEXT` (BOS/EOS per metadata, special tokens parsed)
and the same with `--no-special`, and writes tests/fixtures/tokenizer/oracle_ids.json.
(`--text` rather than `--file`: the oracle opens files in Python text mode,
which would turn the corpus's `\r\n` into `\n`.)

`chat`: renders a two-turn conversation through each GGUF's own
`tokenizer.chat_template` with Python jinja2 configured the way Hugging Face
transformers configures it (trim_blocks, lstrip_blocks, loopcontrols,
raise_exception, tojson = json.dumps(ensure_ascii=False)), and writes
tests/fixtures/tokenizer/chat_<model>.json.
"""
import json, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "crates/flatrun-model/tests/fixtures/tokenizer"
MODELS = Path(os.environ.get("FLATRUN_MODELS", Path.home() / ".cache/flatrun/models"))
VOCAB = Path(os.environ.get("FLATRUN_VOCAB", Path.home() / ".cache/flatrun/vocab"))
ORACLE = os.environ.get("ORACLE", "oracle")

REAL = ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]
VOCAB_ONLY = ["ggml-vocab-llama-spm.gguf", "ggml-vocab-llama-bpe.gguf", "ggml-vocab-phi-3.gguf",
              "ggml-vocab-deepseek-llm.gguf", "ggml-vocab-falcon.gguf", "ggml-vocab-command-r.gguf"]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4."},
    {"role": "user", "content": "And 3+3?  Answer briefly.\n"},
]


def oracle_ids(model, text, special):
    cmd = [ORACLE, "tokenize", str(model), "--text", text] + ([] if special else ["--no-special"])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def gen_ids():
    texts = {p.stem: p.read_bytes().decode("utf-8") for p in sorted((FIX / "corpus").glob("*.txt"))}
    result = {}
    for name in REAL + VOCAB_ONLY:
        path = (MODELS if name in REAL else VOCAB) / name
        result[name] = {t: {"special": oracle_ids(path, s, True), "no_special": oracle_ids(path, s, False)} for t, s in texts.items()}
        print(name, "done", file=sys.stderr)
    (FIX / "oracle_ids.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def gen_chat():
    import gguf, jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    for name, short in [("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"), ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5")]:
        reader = gguf.GGUFReader(str(MODELS / name))
        field = reader.fields["tokenizer.chat_template"]
        template = bytes(field.parts[field.data[0]]).decode("utf-8")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        compiled = env.from_string(template)
        cases = []
        for n_messages, gen_prompt in [(4, True), (3, False), (2, True)]:
            msgs = CONVERSATION[:n_messages] if n_messages != 2 else CONVERSATION[1:3]
            rendered = compiled.render(messages=msgs, add_generation_prompt=gen_prompt, bos_token="<BOS>", eos_token="<EOS>")
            cases.append({"messages": msgs, "add_generation_prompt": gen_prompt, "bos_token": "<BOS>", "eos_token": "<EOS>", "rendered": rendered})
        out = {"model": name, "template": template, "cases": cases}
        (FIX / f"chat_{short}.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(short, "done", file=sys.stderr)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("chat", "all"):
        gen_chat()
    if what in ("ids", "all"):
        gen_ids()
