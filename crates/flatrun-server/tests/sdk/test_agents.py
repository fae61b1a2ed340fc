"""Agent and structured-output features of a running Flatrun server on
Qwen2.5-Coder-0.5B-Instruct, through the official `openai` and `anthropic`
Python SDKs: tool loops in both APIs (streamed and not), forced tool calls
and `json_schema` output validated with `jsonschema` on 50 seeded tries,
logprobs against llama.cpp's (a committed golden file), and the effect of
each penalty and of `logit_bias`.

Environment:
  FLATRUN_BASE_URL        server root (required)
  FLATRUN_SDK_MODEL       served model name (required)
  FLATRUN_LOGPROB_GOLDEN  tests/data/logprobs_qwen05b.json (default: next to this file)

Run: python test_agents.py -v   (crates/flatrun-server/tests/agents_sdk.rs runs it)
"""

import json
import os
import unittest
import urllib.request

import anthropic
import jsonschema
import openai

BASE_URL = os.environ.get("FLATRUN_BASE_URL", "").rstrip("/")
MODEL = os.environ.get("FLATRUN_SDK_MODEL", "")
GOLDEN = os.environ.get(
    "FLATRUN_LOGPROB_GOLDEN",
    os.path.join(os.path.dirname(__file__), "..", "data", "logprobs_qwen05b.json"),
)
# Log-probabilities of the same tokens agree with llama.cpp's to this much
# (both dequantize Q4_K/Q6_K; llama.cpp also quantizes activations to 8 bits).
LOGPROB_TOLERANCE = 0.1
TRIES = 50
BATCH = 25

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": WEATHER_SCHEMA,
    },
}]
ANTHROPIC_TOOLS = [{
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": WEATHER_SCHEMA,
}]
QUESTION = "What is the weather like in Paris right now? Use the get_weather tool."
# After the tool result the 0.5B model (llama.cpp's greedy output on the same
# prompt is the same) writes the call again as bare JSON instead of answering,
# so the loop's last turn asks about the result, as an agent's user would.
FOLLOW_UP = "What temperature did the tool report? Answer in words."
RESULT = json.dumps({"city": "Paris", "temperature": 21, "unit": "celsius", "condition": "sunny"})


def oai():
    return openai.OpenAI(base_url=BASE_URL + "/v1", api_key="none", max_retries=0, timeout=600)


def claude():
    return anthropic.Anthropic(base_url=BASE_URL, api_key="none", max_retries=0, timeout=600)


def post(path, body):
    request = urllib.request.Request(
        BASE_URL + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def token_id(text):
    tokens = post("/tokenize", {"content": text})["tokens"]
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


class OpenAITools(unittest.TestCase):
    def first_turn(self, stream):
        # The 0.5B model answers this question in prose under `auto`, so the
        # loop starts with a required call; the final answer is under `auto`.
        messages = [{"role": "user", "content": QUESTION}]
        kwargs = dict(model=MODEL, messages=messages, tools=OPENAI_TOOLS, temperature=0, max_tokens=100,
                      tool_choice="required")
        if not stream:
            choice = oai().chat.completions.create(**kwargs).choices[0]
            self.assertEqual(choice.finish_reason, "tool_calls")
            calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        else:
            calls, finish = {}, None
            for chunk in oai().chat.completions.create(stream=True, **kwargs):
                choice = chunk.choices[0]
                for delta in choice.delta.tool_calls or []:
                    entry = calls.setdefault(delta.index, ["", "", ""])
                    entry[0] += delta.id or ""
                    entry[1] += (delta.function.name or "") if delta.function else ""
                    entry[2] += (delta.function.arguments or "") if delta.function else ""
                finish = choice.finish_reason or finish
            self.assertEqual(finish, "tool_calls")
            calls = [tuple(calls[i]) for i in sorted(calls)]
        self.assertGreaterEqual(len(calls), 1)
        call_id, name, arguments = calls[0]
        self.assertEqual(name, "get_weather")
        self.assertTrue(call_id.startswith("call_"))
        self.assertIn("paris", json.loads(arguments)["city"].lower())
        return messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULT},
            {"role": "user", "content": FOLLOW_UP},
        ]

    def final_answer(self, messages, stream):
        kwargs = dict(model=MODEL, messages=messages, tools=OPENAI_TOOLS, temperature=0, max_tokens=60)
        if stream:
            text = "".join(
                c.choices[0].delta.content or "" for c in oai().chat.completions.create(stream=True, **kwargs)
                if c.choices
            )
        else:
            choice = oai().chat.completions.create(**kwargs).choices[0]
            self.assertEqual(choice.finish_reason, "stop")
            text = choice.message.content
        self.assertIn("21", text)

    def test_tool_loop(self):
        self.final_answer(self.first_turn(stream=False), stream=False)

    def test_tool_loop_streamed(self):
        self.final_answer(self.first_turn(stream=True), stream=True)

    def test_forced_named_tool_is_schema_valid_every_time(self):
        valid = 0
        for seed in range(TRIES // BATCH):
            response = oai().chat.completions.create(
                model=MODEL, n=BATCH, seed=seed, temperature=1, max_tokens=80,
                messages=[{"role": "user", "content": "I am going to Lyon tomorrow."}],
                tools=OPENAI_TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
            self.assertEqual(len(response.choices), BATCH)
            for choice in response.choices:
                call = choice.message.tool_calls[0]
                self.assertEqual(call.function.name, "get_weather")
                jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
                valid += 1
        self.assertEqual(valid, TRIES)

    def test_json_schema_strict_validates_every_time(self):
        schema = {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
            },
            "required": ["name", "age", "languages"],
            "additionalProperties": False,
        }
        valid = 0
        for seed in range(TRIES // BATCH):
            response = oai().chat.completions.create(
                model=MODEL, n=BATCH, seed=100 + seed, temperature=1, max_tokens=120,
                messages=[{"role": "user", "content": "Describe a fictional programmer as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "programmer", "strict": True, "schema": schema}},
            )
            for choice in response.choices:
                jsonschema.validate(json.loads(choice.message.content), schema)
                valid += 1
        self.assertEqual(valid, TRIES)

    def test_json_object(self):
        response = oai().chat.completions.create(
            model=MODEL, temperature=0, max_tokens=60, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Give me a JSON object with a greeting."}],
        )
        self.assertIsInstance(json.loads(response.choices[0].message.content), dict)

    def test_unknown_tool_in_tool_choice_is_400(self):
        with self.assertRaises(openai.BadRequestError):
            oai().chat.completions.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}], tools=OPENAI_TOOLS,
                tool_choice={"type": "function", "function": {"name": "launch_rocket"}},
            )

    def test_tool_message_without_call_is_400(self):
        with self.assertRaises(openai.BadRequestError):
            oai().chat.completions.create(
                model=MODEL, max_tokens=5, tools=OPENAI_TOOLS,
                messages=[{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "call_nope", "content": "1"}],
            )

    def test_malformed_tool_schema_is_400(self):
        with self.assertRaises(openai.BadRequestError):
            oai().chat.completions.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}],
            )


class Logprobs(unittest.TestCase):
    def test_completion_logprobs_match_llama_cpp(self):
        with open(GOLDEN) as f:
            golden = json.load(f)
        response = oai().completions.create(
            model=MODEL, prompt=golden["prompt"], max_tokens=len(golden["steps"]), temperature=0, logprobs=5,
        )
        choice = response.choices[0]
        self.assertEqual(choice.text, golden["text"])
        ours = choice.logprobs.token_logprobs
        self.assertEqual(len(ours), len(golden["steps"]))
        worst = max(abs(a - s["logprob"]) for a, s in zip(ours, golden["steps"]))
        print(f"largest logprob difference from llama.cpp: {worst:.4f}")
        self.assertLess(worst, LOGPROB_TOLERANCE)
        for top, step in zip(choice.logprobs.top_logprobs, golden["steps"]):
            # The most likely alternative is the same token with the same log-probability.
            best = max(top.values())
            self.assertLess(abs(best - step["top"][0][1]), LOGPROB_TOLERANCE)

    def test_echo_scores_the_text_as_llama_cpp_does(self):
        # The golden's prompt and answer as token ids, scored in one echo
        # request with max_tokens 0 (as evaluation harnesses score a text).
        with open(GOLDEN) as f:
            golden = json.load(f)
        tokens = golden["prompt_tokens"] + [s["token"] for s in golden["steps"]]
        response = oai().completions.create(
            model=MODEL, prompt=tokens, max_tokens=0, echo=True, logprobs=1,
        )
        choice = response.choices[0]
        self.assertEqual(choice.text, golden["prompt"] + golden["text"])
        scores = choice.logprobs.token_logprobs
        self.assertEqual(len(scores), len(tokens))
        self.assertIsNone(scores[0])
        answer = scores[len(golden["prompt_tokens"]):]
        worst = max(abs(a - s["logprob"]) for a, s in zip(answer, golden["steps"]))
        print(f"largest echo logprob difference from llama.cpp: {worst:.4f}")
        self.assertLess(worst, LOGPROB_TOLERANCE)
        self.assertEqual(response.usage.completion_tokens, 0)

    def test_embeddings_through_the_sdk(self):
        # The SDK asks for base64 and decodes it itself.
        texts = ["The cat sat on the mat.", "Quarterly revenue grew by twelve percent."]
        data = oai().embeddings.create(model=MODEL, input=texts).data
        self.assertEqual(len(data), 2)
        vector = data[0].embedding
        self.assertEqual(len(vector), 896)
        self.assertAlmostEqual(sum(x * x for x in vector) ** 0.5, 1.0, places=4)
        # The same vectors as floats: base64 carries the f32 values exactly.
        floats = oai().embeddings.create(model=MODEL, input=texts, encoding_format="float").data
        self.assertEqual([d.embedding for d in floats], [d.embedding for d in data])
        # Alone, the text gets nearly the same vector (other batch shapes
        # take other matmul tiles, which round differently).
        alone = oai().embeddings.create(model=MODEL, input=texts[0]).data[0].embedding
        self.assertGreater(sum(a * b for a, b in zip(vector, alone)), 0.9995)
        self.assertLess(sum(a * b for a, b in zip(vector, data[1].embedding)), 0.9999)

    def test_chat_logprobs_streamed_equal_whole(self):
        kwargs = dict(model=MODEL, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3,
                      messages=[{"role": "user", "content": "Say hello."}])
        whole = oai().chat.completions.create(**kwargs).choices[0]
        entries = whole.logprobs.content
        self.assertEqual("".join(e.token for e in entries), whole.message.content)
        for e in entries:
            self.assertEqual(len(e.top_logprobs), 3)
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(e.logprob, e.top_logprobs[0].logprob, places=5)
        streamed = []
        for chunk in oai().chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                streamed.extend(chunk.choices[0].logprobs.content)
        self.assertEqual([(e.token, round(e.logprob, 4)) for e in streamed],
                         [(e.token, round(e.logprob, 4)) for e in entries])


class SamplingFields(unittest.TestCase):
    PROMPT = [{"role": "user", "content": "Write the word cat twenty times, separated by spaces."}]

    def text(self, **kwargs):
        kwargs.setdefault("max_tokens", 40)
        response = oai().chat.completions.create(model=MODEL, messages=self.PROMPT, **kwargs)
        return response.choices[0].message.content

    def check_formula(self, adjust, **fields):
        """A greedy run with a penalty: at every step the chosen token is the
        argmax of the model's logprobs (reported before any transform) after
        `adjust(logprob, times_seen)`, over the 20 most likely tokens."""
        response = oai().chat.completions.create(
            model=MODEL, messages=self.PROMPT, max_tokens=30, temperature=0, logprobs=True, top_logprobs=20, **fields)
        seen = {}
        changed = 0
        for entry in response.choices[0].logprobs.content:
            key = tuple(entry.bytes)
            chosen = adjust(entry.logprob, seen.get(key, 0))
            for alt in entry.top_logprobs:
                self.assertGreaterEqual(chosen + 1e-3, adjust(alt.logprob, seen.get(tuple(alt.bytes), 0)))
            changed += entry.top_logprobs[0].bytes != entry.bytes
            seen[key] = seen.get(key, 0) + 1
        return changed

    def test_frequency_penalty_follows_its_formula(self):
        changed = self.check_formula(lambda lp, n: lp - 2.0 * n, frequency_penalty=2.0)
        self.assertGreater(changed, 0, "the penalty never changed a token")

    def test_presence_penalty_follows_its_formula(self):
        self.check_formula(lambda lp, n: lp - 2.0 * (n > 0), presence_penalty=2.0)
        self.check_formula(lambda lp, n: lp + 1.0 * (n > 0), presence_penalty=-1.0)

    def test_repeat_penalty_reduces_repetition(self):
        base = self.text(temperature=0).lower().count("cat")
        self.assertGreaterEqual(base, 10)
        self.assertLess(self.text(temperature=0, extra_body={"repeat_penalty": 1.8}).lower().count("cat"), base)

    def test_logit_bias_bans_and_forces(self):
        kwargs = dict(temperature=0, logprobs=True, top_logprobs=2, max_tokens=3)
        first = oai().chat.completions.create(model=MODEL, messages=self.PROMPT, **kwargs).choices[0].logprobs.content[0]
        banned = token_id(first.token)
        other = oai().chat.completions.create(
            model=MODEL, messages=self.PROMPT, logit_bias={str(banned): -100}, **kwargs
        ).choices[0].logprobs.content[0]
        self.assertNotEqual(other.token, first.token)
        # The next most likely token takes its place (logprobs are before the bias).
        self.assertEqual(other.token, first.top_logprobs[1].token if first.top_logprobs else other.token)
        forced = token_id(" banana")
        text = self.text(temperature=0, max_tokens=3, logit_bias={str(forced): 100})
        self.assertEqual(text, " banana" * 3)
        # Logprobs are the model's, before the bias.
        biased = oai().chat.completions.create(
            model=MODEL, messages=self.PROMPT, logit_bias={str(forced): 100}, **kwargs
        ).choices[0].logprobs.content[0]
        self.assertEqual(biased.token, " banana")
        self.assertLess(biased.logprob, first.logprob)

    def test_min_p_one_and_top_k_one_are_greedy(self):
        greedy = self.text(temperature=0)
        self.assertEqual(self.text(temperature=1.5, seed=5, extra_body={"min_p": 1.0}), greedy)
        self.assertEqual(self.text(temperature=1.5, seed=6, extra_body={"top_k": 1}), greedy)

    def test_seed_and_n(self):
        a = oai().chat.completions.create(model=MODEL, messages=self.PROMPT, max_tokens=20, temperature=1, seed=9, n=3)
        b = oai().chat.completions.create(model=MODEL, messages=self.PROMPT, max_tokens=20, temperature=1, seed=9, n=3)
        self.assertEqual([c.message.content for c in a.choices], [c.message.content for c in b.choices])
        self.assertEqual([c.index for c in a.choices], [0, 1, 2])
        self.assertEqual(a.usage.completion_tokens, sum(
            len(post("/tokenize", {"content": c.message.content})["tokens"]) for c in a.choices
        ) if all(c.finish_reason == "length" for c in a.choices) else a.usage.completion_tokens)

    def test_stop_and_usage_in_stream(self):
        chunks = list(oai().chat.completions.create(
            model=MODEL, messages=self.PROMPT, max_tokens=40, temperature=0, stop=["cat cat", "dog", "x", "y"],
            stream=True, stream_options={"include_usage": True}, user="someone",
        ))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertNotIn("cat cat", text)
        self.assertGreater(chunks[-1].usage.completion_tokens, 0)
        with self.assertRaises(openai.BadRequestError):
            self.text(stop=["a", "b", "c", "d", "e"])


class AnthropicTools(unittest.TestCase):
    def turn(self, messages, stream, **kwargs):
        args = dict(model=MODEL, max_tokens=100, messages=messages, tools=ANTHROPIC_TOOLS,
                    extra_body={"temperature": 0}, metadata={"user_id": "u1"}, **kwargs)
        if stream:
            with claude().messages.stream(**args) as s:
                return s.get_final_message()
        return claude().messages.create(**args)

    def loop(self, stream):
        messages = [{"role": "user", "content": QUESTION}]
        first = self.turn(messages, stream, tool_choice={"type": "any"})
        self.assertEqual(first.stop_reason, "tool_use")
        use = [b for b in first.content if b.type == "tool_use"][0]
        self.assertEqual(use.name, "get_weather")
        self.assertIn("paris", use.input["city"].lower())
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT},
                                         {"type": "text", "text": FOLLOW_UP}]},
        ]
        second = self.turn(messages, stream)
        self.assertEqual(second.stop_reason, "end_turn")
        self.assertIn("21", "".join(b.text for b in second.content if b.type == "text"))

    def test_tool_loop(self):
        self.loop(stream=False)

    def test_tool_loop_streamed(self):
        self.loop(stream=True)

    def test_forced_tool_is_schema_valid(self):
        for seed in range(5):
            message = claude().messages.create(
                model=MODEL, max_tokens=80, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                messages=[{"role": "user", "content": "Tell me a joke."}], extra_body={"temperature": 1, "seed": seed},
            )
            self.assertEqual(message.stop_reason, "tool_use")
            use = [b for b in message.content if b.type == "tool_use"][0]
            jsonschema.validate(use.input, WEATHER_SCHEMA)

    def test_refusals_are_400(self):
        bad = [
            dict(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "launch_rocket"},
                 messages=[{"role": "user", "content": "Hi"}]),
            dict(tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}]),
            dict(tools=[{"name": "f", "input_schema": {"type": "object", "required": "x"}}],
                 messages=[{"role": "user", "content": "Hi"}]),
        ]
        for kwargs in bad:
            with self.subTest(kwargs=kwargs), self.assertRaises(anthropic.BadRequestError):
                claude().messages.create(model=MODEL, max_tokens=5, **kwargs)


if __name__ == "__main__":
    if not BASE_URL or not MODEL:
        raise SystemExit("set FLATRUN_BASE_URL and FLATRUN_SDK_MODEL")
    unittest.main()
