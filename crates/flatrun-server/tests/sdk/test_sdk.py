"""Drives a running Flatrun server with the official `openai` and `anthropic`
Python SDKs (and raw HTTP through `urllib` where the SDKs cannot send what
a test needs, e.g. malformed JSON).

Environment:
  FLATRUN_BASE_URL        server root, e.g. http://127.0.0.1:8080 (required)
  FLATRUN_SDK_MODEL       the served model name (required)
  FLATRUN_SDK_API_KEY     the server's API key, if it has one (then wrong keys
                          must be refused)
  FLATRUN_SDK_CONTEXT     the model's context length (for the overflow test;
                          default 1000000 tokens of max_tokens always overflows)
  FLATRUN_SDK_MAX_BODY    the server's body limit in bytes (default 4 MiB)
  FLATRUN_SDK_MOCK=1      the server runs the mock model: check exact texts
  FLATRUN_SDK_GREEDY_PROMPT / FLATRUN_SDK_GREEDY_EXPECTED
                          optional: a user prompt and the exact greedy answer
                          (e.g. from `flatrun run --chat`) the server must give
  FLATRUN_SDK_GREEDY_MAX  max_tokens for that check (default 32)

Run: python test_sdk.py -v   (plain unittest, no pytest needed)
"""

import json
import os
import unittest

import anthropic
import urllib.error
import urllib.request
import openai

BASE_URL = os.environ.get("FLATRUN_BASE_URL", "").rstrip("/")
MODEL = os.environ.get("FLATRUN_SDK_MODEL", "")
API_KEY = os.environ.get("FLATRUN_SDK_API_KEY") or "no-key"
HAS_KEY = bool(os.environ.get("FLATRUN_SDK_API_KEY"))
CONTEXT = int(os.environ.get("FLATRUN_SDK_CONTEXT", "1000000"))
MAX_BODY = int(os.environ.get("FLATRUN_SDK_MAX_BODY", str(4 * 1024 * 1024)))
MOCK = os.environ.get("FLATRUN_SDK_MOCK") == "1"
MOCK_REPLY = "Hello from the Flatrun mock model."
# Recent `anthropic` SDKs dropped the sampling keywords from `messages.create`;
# the wire fields still work, so send them as extra body fields.
GREEDY = {"extra_body": {"temperature": 0}}


def openai_client(api_key=API_KEY):
    return openai.OpenAI(base_url=BASE_URL + "/v1", api_key=api_key, max_retries=0, timeout=120)


def anthropic_client(api_key=API_KEY):
    return anthropic.Anthropic(base_url=BASE_URL, api_key=api_key, max_retries=0, timeout=120)


class RawResponse:
    def __init__(self, status_code, text):
        self.status_code = status_code
        self.text = text

    def json(self):
        return json.loads(self.text)


def raw_request(method, path, content=None):
    """One HTTP request with the API key; returns status and body even on errors."""
    if isinstance(content, str):
        content = content.encode()
    request = urllib.request.Request(BASE_URL + path, data=content, method=method, headers={
        "content-type": "application/json", "authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return RawResponse(response.status, response.read().decode())
    except urllib.error.HTTPError as error:
        return RawResponse(error.code, error.read().decode())


def raw_post(path, content):
    return raw_request("POST", path, content)


class OpenAITests(unittest.TestCase):
    def setUp(self):
        self.client = openai_client()

    def test_models_list(self):
        ids = [m.id for m in self.client.models.list()]
        self.assertIn(MODEL, ids)

    def test_chat_non_streaming(self):
        r = self.client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=16,
            messages=[{"role": "system", "content": "You are brief."},
                      {"role": "user", "content": "Say hello."}])
        choice = r.choices[0]
        self.assertEqual(choice.message.role, "assistant")
        self.assertIsInstance(choice.message.content, str)
        self.assertIn(choice.finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 0)
        self.assertLessEqual(r.usage.completion_tokens, 16)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        if MOCK:
            self.assertEqual(choice.message.content, MOCK_REPLY[:16])
            self.assertEqual(choice.finish_reason, "length")

    def test_chat_text_parts_and_max_completion_tokens(self):
        r = self.client.chat.completions.create(
            model=MODEL, temperature=0, max_completion_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
        self.assertLessEqual(r.usage.completion_tokens, 4)
        if MOCK:
            self.assertEqual(r.choices[0].message.content, "Hell")

    def test_chat_streaming_with_usage(self):
        stream = self.client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=24, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Count to five."}])
        chunks = list(stream)
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(len(finishes), 1)
        self.assertIn(finishes[0], ("stop", "length"))
        self.assertEqual(chunks[-1].choices, [])
        self.assertGreater(chunks[-1].usage.completion_tokens, 0)
        self.assertGreater(chunks[-1].usage.prompt_tokens, 0)
        # The streamed text equals the non-streamed greedy text.
        whole = self.client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": "Count to five."}])
        self.assertEqual(text, whole.choices[0].message.content)
        if MOCK:
            self.assertEqual(text, MOCK_REPLY[:24])

    def test_stop_strings(self):
        r = self.client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=40, stop=["Flatrun", "\n\n"],
            messages=[{"role": "user", "content": "Hi"}])
        self.assertNotIn("Flatrun", r.choices[0].message.content)
        if MOCK:
            self.assertEqual(r.choices[0].message.content, "Hello from the ")
            self.assertEqual(r.choices[0].finish_reason, "stop")

    def test_seed_is_reproducible(self):
        kwargs = dict(model=MODEL, temperature=1.0, top_p=0.95, seed=1234, max_tokens=12,
                      messages=[{"role": "user", "content": "Tell me a word."}])
        a = self.client.chat.completions.create(**kwargs).choices[0].message.content
        b = self.client.chat.completions.create(**kwargs).choices[0].message.content
        self.assertEqual(a, b)

    def test_completions(self):
        r = self.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
        self.assertEqual(r.object, "text_completion")
        self.assertIsInstance(r.choices[0].text, str)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        streamed = "".join(c.choices[0].text for c in self.client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
        self.assertEqual(streamed, r.choices[0].text)
        if MOCK:
            self.assertEqual(r.choices[0].text, MOCK_REPLY[:8])

    def test_unknown_model_is_404(self):
        with self.assertRaises(openai.NotFoundError) as e:
            self.client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        self.assertEqual(e.exception.body["code"], "model_not_found")

    def test_n_over_64_is_400(self):
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(model=MODEL, n=65, messages=[{"role": "user", "content": "x"}])

    def test_context_overflow_is_400(self):
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.chat.completions.create(model=MODEL, max_tokens=CONTEXT,
                                                messages=[{"role": "user", "content": "x"}])
        self.assertEqual(e.exception.body["code"], "context_length_exceeded")

    def test_wrong_types_are_400(self):
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(model=MODEL, messages="not a list")
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(model=MODEL, max_tokens="ten",
                                                messages=[{"role": "user", "content": "x"}])

    def test_malformed_json_is_400_in_openai_shape(self):
        r = raw_post("/v1/chat/completions", b'{"model": "x", "messages": [')
        self.assertEqual(r.status_code, 400)
        body = r.json()
        self.assertEqual(set(body["error"]), {"message", "type", "param", "code"})
        self.assertEqual(body["error"]["type"], "invalid_request_error")

    def test_oversized_body_is_413(self):
        with self.assertRaises(openai.APIStatusError) as e:
            self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * (MAX_BODY + 1)}])
        self.assertEqual(e.exception.status_code, 413)

    @unittest.skipUnless(HAS_KEY, "the server has no API key")
    def test_wrong_api_key_is_401(self):
        with self.assertRaises(openai.AuthenticationError):
            openai_client("wrong-key").models.list()

    @unittest.skipUnless(os.environ.get("FLATRUN_SDK_GREEDY_PROMPT"), "no greedy reference given")
    def test_greedy_answer_matches_the_reference(self):
        r = self.client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=int(os.environ.get("FLATRUN_SDK_GREEDY_MAX", "32")),
            messages=[{"role": "user", "content": os.environ["FLATRUN_SDK_GREEDY_PROMPT"]}])
        self.assertEqual(r.choices[0].message.content, os.environ["FLATRUN_SDK_GREEDY_EXPECTED"])


class AnthropicTests(unittest.TestCase):
    def setUp(self):
        self.client = anthropic_client()

    def test_message_non_streaming(self):
        m = self.client.messages.create(
            model=MODEL, max_tokens=16, **GREEDY, system="You are brief.",
            messages=[{"role": "user", "content": "Say hello."}])
        self.assertEqual(m.type, "message")
        self.assertEqual(m.role, "assistant")
        self.assertEqual(m.content[0].type, "text")
        self.assertIn(m.stop_reason, ("end_turn", "max_tokens", "stop_sequence"))
        self.assertGreater(m.usage.input_tokens, 0)
        self.assertLessEqual(m.usage.output_tokens, 16)
        if MOCK:
            self.assertEqual(m.content[0].text, MOCK_REPLY[:16])
            self.assertEqual(m.stop_reason, "max_tokens")

    def test_system_blocks_top_k_and_stop_sequences(self):
        m = self.client.messages.create(
            model=MODEL, max_tokens=40, extra_body={"top_k": 1, "top_p": 0.9}, stop_sequences=["Flatrun"],
            system=[{"type": "text", "text": "You are brief."}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
        self.assertNotIn("Flatrun", m.content[0].text)
        if MOCK:
            self.assertEqual(m.content[0].text, "Hello from the ")
            self.assertEqual(m.stop_reason, "stop_sequence")
            self.assertEqual(m.stop_sequence, "Flatrun")

    def test_streaming_helper(self):
        with self.client.messages.stream(model=MODEL, max_tokens=24, **GREEDY,
                                         messages=[{"role": "user", "content": "Count to five."}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        self.assertEqual(final.content[0].text, text)
        whole = self.client.messages.create(model=MODEL, max_tokens=24, **GREEDY,
                                            messages=[{"role": "user", "content": "Count to five."}])
        self.assertEqual(text, whole.content[0].text)
        self.assertEqual(final.usage.output_tokens, whole.usage.output_tokens)
        if MOCK:
            self.assertEqual(text, MOCK_REPLY[:24])

    def test_streaming_event_order(self):
        events = [e.type for e in self.client.messages.create(
            model=MODEL, max_tokens=8, **GREEDY, stream=True,
            messages=[{"role": "user", "content": "Hi"}])]
        events = [e for e in events if e != "ping"]
        self.assertEqual(events[:2], ["message_start", "content_block_start"])
        self.assertEqual(events[-3:], ["content_block_stop", "message_delta", "message_stop"])
        self.assertTrue(all(e == "content_block_delta" for e in events[2:-3]))

    def test_count_tokens(self):
        kwargs = dict(model=MODEL, system="S", messages=[{"role": "user", "content": "How many tokens?"}])
        counted = self.client.messages.count_tokens(**kwargs).input_tokens
        used = self.client.messages.create(max_tokens=1, **kwargs).usage.input_tokens
        self.assertEqual(counted, used)

    def test_missing_max_tokens_is_400_in_anthropic_shape(self):
        r = raw_post("/v1/messages", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}))
        self.assertEqual(r.status_code, 400)
        body = r.json()
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertIn("max_tokens", body["error"]["message"])

    def test_malformed_json_is_400(self):
        r = raw_post("/v1/messages", b"{nope")
        self.assertEqual(r.status_code, 400)
        self.assertEqual(r.json()["error"]["type"], "invalid_request_error")

    def test_wrong_types_are_400(self):
        with self.assertRaises(anthropic.BadRequestError):
            self.client.messages.create(model=MODEL, max_tokens="many", messages=[{"role": "user", "content": "x"}])

    def test_unknown_model_is_404(self):
        with self.assertRaises(anthropic.NotFoundError):
            self.client.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])

    def test_context_overflow_is_400(self):
        with self.assertRaises(anthropic.BadRequestError):
            self.client.messages.create(model=MODEL, max_tokens=CONTEXT, messages=[{"role": "user", "content": "x"}])

    def test_oversized_body_is_413(self):
        with self.assertRaises(anthropic.APIStatusError) as e:
            self.client.messages.create(model=MODEL, max_tokens=4,
                                        messages=[{"role": "user", "content": "x" * (MAX_BODY + 1)}])
        self.assertEqual(e.exception.status_code, 413)

    @unittest.skipUnless(HAS_KEY, "the server has no API key")
    def test_wrong_api_key_is_401(self):
        with self.assertRaises(anthropic.AuthenticationError):
            anthropic_client("wrong-key").messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])


class ServerEndpointTests(unittest.TestCase):
    def test_health(self):
        r = raw_request("GET", "/health")
        self.assertEqual(r.status_code, 200)
        self.assertEqual(r.json()["status"], "ok")

    def test_metrics(self):
        r = raw_request("GET", "/metrics")
        self.assertEqual(r.status_code, 200)
        self.assertIn("flatrun_requests_total", r.text)
        self.assertIn("flatrun_generated_tokens_total", r.text)

    def test_tokenize_round_trip(self):
        tokens = raw_post("/tokenize", json.dumps({"content": "Hello world"})).json()["tokens"]
        self.assertTrue(tokens)
        text = raw_post("/detokenize", json.dumps({"tokens": tokens})).json()["content"]
        self.assertEqual(text.strip(), "Hello world")


if __name__ == "__main__":
    if not BASE_URL or not MODEL:
        raise SystemExit("set FLATRUN_BASE_URL and FLATRUN_SDK_MODEL")
    unittest.main()
