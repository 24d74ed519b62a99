"""What the demo model learns, generated: small talk, brief reasoning, calls of the tools it is
given (``get_weather(city)``, ``get_time(city)``, ``add(a, b)``; several in one turn when asked
about several cities) and answers from their results. Held out from training: a list of real city
names, the synthetic names and the numbers ``held_out_*`` pick; ``held_out_tasks`` asks about them
and ``score`` says whether a reply is right. Training cities (``_city``): 30 % real training names,
25 % spliced ones (``spliced_city``: the head of one joined to the tail of another), 45 % made up
(``synthetic_city``). The held-out tasks are pinned: changing the training mix does not change them
(tests/demo/test_demo_tasks_data.py holds their digest).

Everything is drawn from a ``random.Random`` seeded by the caller: the same seed gives the same
data. Imports nothing but the standard library (the training script runs it on a bare GPU machine).
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

from moeserve.demo.chat_format import Reply, assistant_completion, read_reply, render_chat


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOLS = {
    "get_weather": _tool(
        "get_weather", "Get the current weather in a city", {"city": {"type": "string", "description": "The city name"}}, ["city"]
    ),
    "get_time": _tool(
        "get_time", "Get the current local time in a city", {"city": {"type": "string", "description": "The city name"}}, ["city"]
    ),
    "add": _tool("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]),
}
ALL_TOOLS = [TOOLS["get_weather"], TOOLS["get_time"], TOOLS["add"]]

TRAIN_CITIES = """Paris London Tokyo Berlin Madrid Rome Vienna Prague Warsaw Oslo Stockholm Helsinki
Copenhagen Dublin Lisbon Athens Istanbul Cairo Lagos Nairobi Accra Dakar Tunis Algiers Casablanca
Johannesburg Cape_Town Durban Addis_Ababa Kampala Kigali Luanda Harare Lusaka Mumbai Delhi Chennai
Kolkata Bangalore Karachi Lahore Dhaka Colombo Bangkok Hanoi Manila Jakarta Singapore Seoul Busan
Beijing Shanghai Shenzhen Hong_Kong Taipei Osaka Kyoto Sapporo Sydney Melbourne Perth Brisbane
Auckland Wellington Toronto Montreal Vancouver Calgary Ottawa Chicago Boston Seattle Denver Dallas
Houston Miami Atlanta Phoenix Portland New_York Los_Angeles San_Francisco San_Diego Mexico_City
Guadalajara Havana Bogota Lima Quito Santiago Buenos_Aires Caracas Rio_de_Janeiro Sao_Paulo Brasilia
Zurich Geneva Munich Hamburg Cologne Frankfurt Milan Naples Venice Florence Barcelona Valencia
Seville Porto Amsterdam Rotterdam Brussels Antwerp Lyon Marseille Nice Bordeaux Edinburgh Glasgow
Manchester Liverpool Cardiff Belfast Budapest Bucharest Sofia Belgrade Zagreb Riga Vilnius Tallinn
Kyiv Minsk Moscow Tbilisi Yerevan Baku Tehran Baghdad Riyadh Dubai Doha Muscat Amman Beirut
Jerusalem Kabul Tashkent Almaty Ulaanbaatar Kathmandu Hobart Anchorage Honolulu Reno Tulsa""".split()
TRAIN_CITIES = [c.replace("_", " ") for c in TRAIN_CITIES]

HELD_OUT_CITIES = """Reykjavik Ljubljana Bratislava Montevideo Asuncion La_Paz Windhoek Gaborone Maputo
Antananarivo Ouagadougou Bamako Niamey Nouakchott Freetown Monrovia Yaounde Libreville Kinshasa
Brazzaville Mogadishu Djibouti Asmara Khartoum Tripoli Valletta Nicosia Skopje Tirana Podgorica
Sarajevo Chisinau Dushanbe Bishkek Ashgabat Thimphu Vientiane Phnom_Penh Naypyidaw Dili Port_Moresby
Suva Apia Nuku'alofa Canberra Darwin Winnipeg Halifax Quebec_City Saskatoon Fairbanks Juneau
Boise Omaha Tacoma Savannah Santa_Fe Valparaiso Cusco Cordoba Rosario Trondheim Bergen Gothenburg
Malmo Aarhus Tampere Uppsala Graz Innsbruck Salzburg Lucerne Bern Basel""".split()
HELD_OUT_CITIES = [c.replace("_", " ") for c in HELD_OUT_CITIES]

_SYLLABLES = (
    "ka lo mi ra ven dor ta sel bri on ga nu po lis ber sha ti mar el zen fa ro ha dun vik sto ne "
    "al be co di fer gu ja ki ly mo qua ri su vo we xa yo zu tor lan mer san bel cas mon val gran "
    "del ar is ul ek om um ang ost rid hel nor sud wes ash"
).split()
_SUFFIXES = ["", "", "", "", "burg", "ville", "ton", "polis", "stad", "grad", "port", "field", "minde", "abad", "pur"]
_PREFIXES = ["", "", "", "", "", "", "", "", "San ", "Port ", "New ", "Lake ", "Fort ", "Saint ", "El ", "Nova "]
_LETTERS = "abcdefghijklmnopqrstuvwxyz" * 3 + "éèáíóúüöäçñãøå"


def synthetic_city(rng: random.Random) -> str:
    """A made-up city name: syllables, or for a fifth of them random letters (so that every
    letter, accented ones too, is copied in training, not only common syllables)."""
    if rng.random() < 0.2:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 10)))
    else:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) + rng.choice(_SUFFIXES)
    name = rng.choice(_PREFIXES) + word.capitalize()
    if rng.random() < 0.08:
        name += " " + "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 2))).capitalize()
    return name


HELD_OUT_SYNTHETIC = tuple(sorted({synthetic_city(random.Random(f"held-out-{i}")) for i in range(400)} - set(TRAIN_CITIES)))
_HELD_OUT_CITY_SET = frozenset(HELD_OUT_CITIES) | frozenset(HELD_OUT_SYNTHETIC)


def is_held_out_number(n: int) -> bool:
    """One number in ten never appears as an argument in training."""
    return zlib.crc32(str(n).encode()) % 10 == 0


def _number(rng: random.Random, held_out: bool) -> int:
    while True:
        digits = rng.choice([1, 2, 2, 3, 3, 3, 4, 4])
        n = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
        if is_held_out_number(n) == held_out:
            return n


_HELD_OUT_FOLDED = frozenset(c.casefold() for c in _HELD_OUT_CITY_SET)
_HELD_OUT_REAL_FOLDED = tuple(c.casefold() for c in HELD_OUT_CITIES)


def spliced_city(rng: random.Random) -> str:
    """The head of one training city joined to the tail of another, each cut at a random
    character so that both parts are non-empty ("Canb" + "erra" is how a held-out name looks to
    the model: known BPE pieces in an order it never saw), capitalised like a name. Teaches
    copying a name piece by piece, not recalling it. Never a held-out city, in any case, nor a
    name holding a real held-out one ("Berne", "Dilisi": about one draw in 4,000 is drawn again)."""
    while True:
        head, tail = rng.sample(TRAIN_CITIES, 2)
        head, tail = head[: rng.randint(1, len(head) - 1)], tail[rng.randint(1, len(tail) - 1) :]
        if head.endswith(" ") or tail.startswith(" "):  # the tail starts a word of its own
            tail = tail.strip()
            name = f"{head.strip()} {tail[0].upper()}{tail[1:]}"
        else:  # one word across the cut
            name = head + tail[0].lower() + tail[1:]
        name = name[0].upper() + name[1:]
        folded = name.casefold()
        if folded not in _HELD_OUT_FOLDED and not any(c in folded for c in _HELD_OUT_REAL_FOLDED):
            return name


def _city(rng: random.Random, held_out: bool, pinned: bool = False) -> str:
    """A city to ask about. Held out: a real held-out name or a held-out synthetic one. Training:
    30 % a training city, 25 % a spliced one (``spliced_city``), 45 % a synthetic one. ``pinned``:
    the earlier turns of held-out samples keep the training mix they were first drawn with (40 %
    training cities, 60 % synthetic), so that ``held_out_tasks`` and ``held_out_text`` stay the same
    tasks whatever the training mix (evaluations of retrained models stay comparable)."""
    if held_out:
        return rng.choice(HELD_OUT_CITIES) if rng.random() < 0.5 else rng.choice(HELD_OUT_SYNTHETIC)
    while True:
        if pinned:
            name = rng.choice(TRAIN_CITIES) if rng.random() < 0.4 else synthetic_city(rng)
        else:
            r = rng.random()
            name = rng.choice(TRAIN_CITIES) if r < 0.3 else spliced_city(rng) if r < 0.55 else synthetic_city(rng)
        if name not in _HELD_OUT_CITY_SET:
            return name


_CONDITIONS = ["sunny", "cloudy", "rainy", "snowy", "windy", "foggy", "clear", "stormy", "partly cloudy", "hazy"]


def weather_result(rng: random.Random, city: str) -> dict:
    return {"city": city, "temperature_c": rng.randint(-25, 42), "condition": rng.choice(_CONDITIONS)}


def time_result(rng: random.Random, city: str) -> dict:
    return {"city": city, "time": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"}


# ---- what users say ----
WEATHER_ASKS = [
    "What's the weather in {c}?",
    "What is the weather like in {c}?",
    "How is the weather in {c} today?",
    "Weather in {c}?",
    "Is it cold in {c} right now?",
    "Tell me the weather for {c}.",
    "Can you check the weather in {c}?",
    "How warm is it in {c}?",
    "what's the weather in {c}",
    "I am flying to {c} tomorrow. What is the weather there?",
]
TIME_ASKS = [
    "What time is it in {c}?",
    "What's the time in {c}?",
    "Tell me the local time in {c}.",
    "What is the current time in {c}?",
    "Do you know what time it is in {c}?",
    "time in {c}?",
    "I need to call a friend in {c}. What time is it there?",
]
ADD_ASKS = [
    "What is {a} plus {b}?",
    "Add {a} and {b}.",
    "What's {a} + {b}?",
    "Please add {a} to {b}.",
    "Compute the sum of {a} and {b}.",
    "How much is {a} + {b}?",
    "Can you add {a} and {b} for me?",
    "{a} + {b} = ?",
]
MULTI_WEATHER_ASKS = [
    "What's the weather in {cs}?",
    "Compare the weather in {cs}.",
    "How is the weather in {cs} today?",
    "Check the weather for {cs}, please.",
    "Weather in {cs}?",
]
MULTI_TIME_ASKS = [
    "What time is it in {cs}?",
    "Tell me the local time in {cs}.",
    "What's the time in {cs}?",
]
BOTH_ASKS = [
    "What time is it in {c}, and what's the weather there?",
    "Tell me the time and the weather in {c}.",
    "I am in {c}. What is the time and how is the weather?",
]


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent Victor Walter MoE Kimi World Friend".split()
SMALL_TALK = [
    (
        ["Hello!", "Hi!", "Hey there!", "Hello", "hi", "Good morning!", "Good evening!", "Hello, {n}!", "Hi {n}!", "Hey {n}, hello!"],
        "The user greets me. I will greet them back.",
        ["Hello! How can I help you today?", "Hi! What can I do for you?", "Hello! Nice to meet you. How can I help?"],
    ),
    (
        ["How are you?", "How are you doing?", "Hi, how are you today?", "Hello {n}, how are you?"],
        "The user asks how I am. I will answer kindly.",
        ["I am doing well, thank you! How can I help you?", "I am fine, thanks for asking. What can I do for you?"],
    ),
    (
        ["Who are you?", "What is your name?", "What are you?", "Are you a bot?"],
        "The user asks who I am. I will introduce myself.",
        [
            "I am a tiny demo model served by moeserve. I can chat and call tools.",
            "I am moeserve's demo model, a very small DeepseekV3. I can chat and call tools.",
        ],
    ),
    (
        ["What can you do?", "How can you help me?", "What are you able to do?", "Help"],
        "The user asks what I can do. I will list my skills.",
        ["I can chat, check the weather, tell the time in a city and add numbers, when you give me the tools for it."],
    ),
    (
        ["Thank you!", "Thanks!", "thanks a lot", "Great, thank you."],
        "The user thanks me. I will reply politely.",
        ["You are welcome!", "You're welcome! Anything else?", "Glad I could help!"],
    ),
    (
        ["Goodbye!", "Bye!", "See you later.", "Good night!"],
        "The user says goodbye. I will say goodbye too.",
        ["Goodbye! Have a nice day.", "Bye! See you soon."],
    ),
    (
        ["Tell me a joke.", "Do you know a joke?", "Make me laugh."],
        "The user wants a joke. I will tell a short one.",
        ["Why did the token smile? It found its expert.", "Why do experts never get lonely? The router always sends company."],
    ),
    (
        ["What is MoE?", "What is a mixture of experts?", "What does MoE mean?"],
        "The user asks about mixture of experts. I will explain briefly.",
        ["MoE means mixture of experts: each token is sent to a few expert networks chosen by a router."],
    ),
]
_UNKNOWN_REASONING = "I do not understand this request. I will say what I can do."
_UNKNOWN_ANSWER = "Sorry, I am a small demo model. I can chat, check the weather, tell the time and add numbers."
_WORDS = (
    "apple river blue quantum pizza music forest laptop ocean garden winter purple dragon castle rocket "
    "coffee banana silver mountain thunder pencil window yellow bridge planet"
).split()

_NO_TOOL = {
    "get_weather": (
        "The user wants the weather in {c}, but I have no weather tool.",
        "Sorry, I cannot check the weather without a weather tool.",
    ),
    "get_time": ("The user wants the time in {c}, but I have no time tool.", "Sorry, I cannot tell the time without a time tool."),
    "add": ("The user wants {a} plus {b}, but I have no add tool.", "Sorry, I cannot add numbers without the add tool."),
}


@dataclass
class Sample:
    """One assistant turn to learn or to test: the conversation before it, the tools declared,
    whether thinking is on, and the message the model should write."""

    messages: list[dict]
    tools: list[dict] | None
    thinking: bool
    target: dict
    kind: str
    expect: dict[str, Any] = field(default_factory=dict)

    def prompt(self) -> str:
        return render_chat(self.messages, self.tools, add_generation_prompt=True, thinking=self.thinking)

    def completion(self) -> str:
        return assistant_completion(self.target, self.thinking)


class _Conversation:
    """Builds one conversation, numbering tool calls across it (functions.NAME:IDX)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.next_call = 0

    def call(self, name: str, args: dict) -> dict:
        call = {
            "id": f"functions.{name}:{self.next_call}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
        }
        self.next_call += 1
        return call


def _assistant(content: str, reasoning: str | None = None, calls: list[dict] | None = None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def _weather_sentence(r: dict) -> str:
    return f"{r['temperature_c']} °C and {r['condition']} in {r['city']}"


def _answer(rng: random.Random, name: str, args: dict, result: dict) -> str:
    if name == "get_weather":
        return rng.choice(["It is {w}.", "Right now it is {w}.", "The weather: {w}."]).format(w=_weather_sentence(result))
    if name == "get_time":
        return rng.choice(["It is {t} in {c}.", "The local time in {c} is {t}."]).format(t=result["time"], c=result["city"])
    return rng.choice(["{a} + {b} = {s}.", "The sum of {a} and {b} is {s}."]).format(a=args["a"], b=args["b"], s=result["result"])


def _multi_answer(results: list[tuple[str, dict, dict]]) -> str:
    parts = []
    for name, args, r in results:
        if name == "get_weather":
            parts.append(f"it is {_weather_sentence(r)}")
        elif name == "get_time":
            parts.append(f"the time in {r['city']} is {r['time']}")
        else:
            parts.append(f"{args['a']} + {args['b']} = {r['result']}")
    text = "; ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] + "."
    return text[0].upper() + text[1:]


def _run_tool(rng: random.Random, name: str, args: dict) -> dict:
    if name == "get_weather":
        return weather_result(rng, args["city"])
    if name == "get_time":
        return time_result(rng, args["city"])
    return {"result": args["a"] + args["b"]}


def _request(rng: random.Random, held_out: bool, pinned: bool = False) -> tuple[str, list[tuple[str, dict]], str]:
    """A user request that needs tools: (text, the calls it needs in order, the reasoning);
    ``pinned``: its cities in the pinned training mix (``_city``)."""
    kind = rng.choices(["weather", "time", "add", "multi_weather", "multi_time", "both"], [6, 4, 6, 3, 2, 1])[0]
    if kind in ("weather", "time"):
        c = _city(rng, held_out, pinned)
        asks, name = (WEATHER_ASKS, "get_weather") if kind == "weather" else (TIME_ASKS, "get_time")
        what = "weather" if kind == "weather" else "time"
        return rng.choice(asks).format(c=c), [(name, {"city": c})], f"The user wants the {what} in {c}. I will call {name}."
    if kind == "add":
        a, b = _number(rng, held_out), _number(rng, held_out)
        return rng.choice(ADD_ASKS).format(a=a, b=b), [("add", {"a": a, "b": b})], f"The user wants {a} plus {b}. I will call add."
    if kind == "both":
        c = _city(rng, held_out, pinned)
        calls = [("get_time", {"city": c}), ("get_weather", {"city": c})]
        return (
            rng.choice(BOTH_ASKS).format(c=c),
            calls,
            f"The user wants the time and the weather in {c}. I will call get_time and get_weather.",
        )
    cities: list[str] = []
    while len(cities) < rng.choice([2, 2, 3]):
        c = _city(rng, held_out, pinned)
        if c not in cities:
            cities.append(c)
    name, asks, what = ("get_weather", MULTI_WEATHER_ASKS, "weather") if kind == "multi_weather" else ("get_time", MULTI_TIME_ASKS, "time")
    text = rng.choice(asks).format(cs=_join(cities))
    reasoning = f"The user wants the {what} in {len(cities)} cities. I will call {name} for each: {_join(cities)}."
    return text, [(name, {"city": c}) for c in cities], reasoning


def _small_talk(rng: random.Random) -> tuple[str, str, str]:
    if rng.random() < 0.12:
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5)))
        return (text.capitalize() + rng.choice(["", "?", "."]), _UNKNOWN_REASONING, _UNKNOWN_ANSWER)
    asks, reasoning, answers = rng.choice(SMALL_TALK)
    return rng.choice(asks).format(n=rng.choice(_NAMES)), reasoning, rng.choice(answers)


def _tools_for(rng: random.Random, needed: set[str]) -> list[dict] | None:
    """The declared tools: usually all three, sometimes a subset with the needed ones, in any order."""
    if rng.random() < 0.6:
        return list(ALL_TOOLS)
    names = set(needed) | {n for n in TOOLS if rng.random() < 0.5}
    tools = [TOOLS[n] for n in TOOLS if n in names]
    rng.shuffle(tools)
    return tools or None


def _history(rng: random.Random, conv: _Conversation, tools: list[dict] | None, pinned: bool = False) -> list[dict]:
    """Earlier turns of the conversation: small talk or a finished tool exchange (about training
    cities and numbers; ``pinned`` for a held-out sample: its cities in the pinned mix, ``_city``)."""
    history: list[dict] = []
    for _ in range(rng.choice([1, 1, 2])):
        declared = {t["function"]["name"] for t in tools or []}
        text, calls, reasoning = _request(rng, held_out=False, pinned=pinned)
        if rng.random() < 0.5 and all(n in declared for n, _ in calls):
            tool_calls = [conv.call(n, a) for n, a in calls]
            history += [{"role": "user", "content": text}, _assistant("", reasoning, tool_calls)]
            results = []
            for call, (n, a) in zip(tool_calls, calls):
                r = _run_tool(rng, n, a)
                results.append((n, a, r))
                history.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(r, ensure_ascii=False)})
            history.append(_assistant(_multi_answer(results) if len(results) > 1 else _answer(rng, *results[0])))
        else:
            text, reasoning, answer = _small_talk(rng)
            history += [{"role": "user", "content": text}, _assistant(answer, reasoning)]
    return history


def make_sample(rng: random.Random, held_out: bool = False) -> Sample:
    """One training (or, with ``held_out``, test) sample."""
    conv = _Conversation(rng)
    thinking = rng.random() < 0.7
    kind = rng.choices(["chat", "call", "answer", "no_tool"], [3, 6, 5, 1])[0]
    if held_out:  # held-out tasks test tool calls and answers from results
        kind = "call" if kind in ("chat", "no_tool") else kind
    text, calls, reasoning = _request(rng, held_out)
    needed = {n for n, _ in calls}
    tools = _tools_for(rng, needed)
    if kind == "no_tool":
        missing = [n for n in needed if n not in {t["function"]["name"] for t in tools or []}]
        if not missing:
            tools = [t for t in ALL_TOOLS if t["function"]["name"] not in needed] or None
            missing = sorted(needed)
        name = missing[0]
        args = calls[0][1]
        r, a = _NO_TOOL[name]
        fmt = {"c": args.get("city", ""), "a": args.get("a", ""), "b": args.get("b", "")}
        messages = _history(rng, conv, tools, pinned=held_out) if rng.random() < 0.2 else []
        messages.append({"role": "user", "content": text})
        return Sample(messages, tools, thinking, _assistant(a, r.format(**fmt)), "no_tool")
    if kind == "chat":
        text, reasoning, answer = _small_talk(rng)
        tools = tools if rng.random() < 0.7 else None
        messages = _history(rng, conv, tools, pinned=held_out) if rng.random() < 0.2 else []
        messages.append({"role": "user", "content": text})
        return Sample(messages, tools, thinking, _assistant(answer, reasoning), "chat")
    tools = [t for t in tools or []] + [TOOLS[n] for n in sorted(needed) if TOOLS[n] not in (tools or [])]
    messages = _history(rng, conv, tools, pinned=held_out) if rng.random() < 0.25 else []
    messages.append({"role": "user", "content": text})
    tool_calls = [conv.call(n, a) for n, a in calls]
    call_message = _assistant("", reasoning, tool_calls)
    if kind == "call":
        return Sample(messages, tools, thinking, call_message, "call", {"calls": calls, "ids": [c["id"] for c in tool_calls]})
    messages.append(call_message)
    results = []
    for call, (n, a) in zip(tool_calls, calls):
        r = _run_tool(rng, n, a)
        results.append((n, a, r))
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(r, ensure_ascii=False)})
    answer = _multi_answer(results) if len(results) > 1 else _answer(rng, *results[0])
    reasoning = rng.choice(["The tool returned the result. I will answer.", "I have the results. I will tell the user."])
    expect = [str(v) for _, _, r in results for k, v in r.items() if k != "city"] + [r["city"] for _, _, r in results if "city" in r]
    return Sample(messages, tools, thinking, _assistant(answer, reasoning), "answer", {"contains": expect})


def training_samples(seed: int, n: int, start: int = 0) -> list[Sample]:
    """Samples ``start .. start + n`` of the training stream of ``seed`` (each its own rng, so
    any slice can be made independently, e.g. by parallel workers)."""
    return [make_sample(random.Random(f"{seed}-train-{i}")) for i in range(start, start + n)]


def held_out_tasks(n: int = 200, seed: int = 0) -> list[Sample]:
    """Tool-call and answer tasks about held-out cities and numbers, thinking on and off."""
    return [make_sample(random.Random(f"{seed}-held-out-{i}"), held_out=True) for i in range(n)]


def held_out_text(n: int = 200) -> list[Sample]:
    """Held-out conversations (their own stream) for perplexity and MTP accuracy."""
    return [make_sample(random.Random(f"held-out-text-{i}"), held_out=True) for i in range(n)]


def score(sample: Sample, reply: Reply) -> bool:
    """A tool-call task: exactly the expected calls (names and JSON arguments, in order). An
    answer task: no call, and the content holds every value of the tool results (temperature,
    condition, time, sum) and the city. Anything else: a non-empty answer without calls."""
    if sample.kind == "call":
        return [(c.name, c.parsed_arguments()) for c in reply.tool_calls] == [(n, a) for n, a in sample.expect["calls"]]
    if sample.kind == "answer":
        return not reply.tool_calls and all(s in reply.content for s in sample.expect["contains"])
    return not reply.tool_calls and bool(reply.content.strip())


# Generation budget of an evaluation: the longest held-out reply (three calls, thinking on, long
# made-up names) is 128 tokens; a budget of 96 cut eleven of 300 and scored them as misses.
REPLY_MAX_TOKENS = 192


def accuracy(samples: list[Sample], texts: list[str]) -> dict[str, float]:
    """Scores of raw completions (decoded keeping the reasoning and tool-call tokens): the share
    of call tasks and of answer tasks right (``score``), and of call tasks with exact ids."""
    replies = [read_reply(t, s.thinking) for s, t in zip(samples, texts)]
    result = {}
    for kind in ("call", "answer"):
        pairs = [(s, r) for s, r in zip(samples, replies) if s.kind == kind]
        result[kind] = sum(score(s, r) for s, r in pairs) / max(1, len(pairs))
    calls = [(s, r) for s, r in zip(samples, replies) if s.kind == "call"]
    result["ids"] = sum(ids_exact(s, r) for s, r in calls) / max(1, len(calls))
    return result


def ids_exact(sample: Sample, reply: Reply) -> bool:
    """A tool-call task's call ids are the expected ``functions.NAME:IDX`` (IDX counts the
    conversation's calls, earlier turns' too)."""
    return [c.id for c in reply.tool_calls] == sample.expect.get("ids")
