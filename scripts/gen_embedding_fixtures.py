#!/usr/bin/env python3
"""Make the embedding fidelity fixtures from a reference llama.cpp build.

For each model it starts `llama-server --embeddings --pooling mean -fa off` (the
pooling Flatrun uses for a decoder checkpoint that names none), posts the
texts below to its OpenAI-shaped `/v1/embeddings` (which L2-normalizes, as
Flatrun does) and records the vectors.

Usage (not run by CI; needs the reference build):
  scripts/gen_embedding_fixtures.py --llama-server PATH/TO/llama-server [--models DIR]
Writes crates/flatrun-runtime/tests/fixtures/embeddings/<model>.json.
"""
import argparse, json, os, socket, subprocess, sys, time, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "crates", "flatrun-runtime", "tests", "fixtures", "embeddings")

MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
]

TEXTS = [
    "The cat sat on the mat.",
    "A kitten was sitting on the rug, purring quietly in the afternoon sun.",
    "Quarterly revenue grew by twelve percent, driven by strong demand in Asia.",
    "def add(a, b):\n    return a + b\n",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embed(server, model_path, texts):
    port = free_port()
    command = [server, "-m", model_path, "--embeddings", "--pooling", "mean", "--port", str(port),
               "--host", "127.0.0.1", "-t", "2", "-c", "2048", "-ub", "2048", "-b", "2048", "-fa", "off"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        body = json.dumps({"input": texts, "model": "m"}).encode()
        request = urllib.request.Request(base + "/v1/embeddings", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            data = json.load(r)["data"]
        shown = ["llama-server"] + [a for a in command[1:] if a not in ("--port", str(port), "--host", "127.0.0.1")]
        return " ".join(shown), [d["embedding"] for d in data]
    finally:
        proc.terminate()
        proc.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--models", default=os.environ.get(
        "FLATRUN_MODELS", os.path.expanduser("~/.cache/flatrun/models")))
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    for name in MODELS:
        path = os.path.join(args.models, name)
        if not os.path.exists(path):
            sys.exit(f"{path} is missing (scripts/fetch-models.py)")
        command, vectors = embed(args.llama_server, path, TEXTS)
        fixture = {
            "model": name,
            "generator": "scripts/gen_embedding_fixtures.py --llama-server LLAMA_SERVER "
                         "(llama-server --embeddings --pooling mean; POST /v1/embeddings)",
            "reference": "llama.cpp vendored in llama-cpp-python 0.3.36, CPU",
            "command": command.replace(args.models, "$FLATRUN_MODELS"),
            "texts": TEXTS,
            "embeddings": [[round(x, 7) for x in v] for v in vectors],
        }
        out = os.path.join(OUT, name.rsplit(".gguf", 1)[0] + ".json")
        with open(out, "w") as f:
            json.dump(fixture, f)
            f.write("\n")
        print(f"{out}: {len(vectors)} vectors of {len(vectors[0])}")


if __name__ == "__main__":
    main()
