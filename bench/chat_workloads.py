"""Chat workloads of real text, for benches where what the model writes matters.

`bench/workloads.py`'s shapes fill prompts with random words: right for measuring the
cache, useless where the output's content decides the speed (speculative decoding drafts
from text the model has seen). These four are ChatML conversations (the default model's
chat template) of real sentences, built from slot lists deterministically from a seed,
as `bench.workloads.Workload`s whose `output_tokens` is each request's `max_new_tokens`:

- `agent`: a system prompt describing tools (JSON schemas) with one worked example, a
  user's task; the model answers with a tool call, the tool's JSON result comes back
  (quoting the task's cities, dates, codes), and the model goes on: its outputs repeat
  the prompt's JSON keys, tool names and strings;
- `extraction`: a few-shot prompt (paragraphs about people -> a JSON list of their
  fields), then a new paragraph: the answer copies its spans from the input;
- `repeated_question`: questions asked again (as users ask what others asked before):
  each question once before the timed run (`split_history`), then `repeats` times in
  it, every question once before any again, so every timed asking can draft from an
  earlier answer the radix tree holds;
- `control`: distinct writing requests, each once, no system prompt (free-form answers).

`conversations` is how many independent conversations (or timed askings) a run has; a
run drives them `batch` at a time. Turns of one conversation name their `parent`
(`Workload.prompt`); the model's end-of-turn token is stripped from a parent's output
before the next segment, which opens with `<|im_end|>` itself.
"""

from __future__ import annotations

import inspect
import json
import random
from dataclasses import replace
from typing import Callable, Sequence

from bench.workloads import IM_END, IM_START, Encode, Request, Workload

CHAT_WORKLOADS = ("agent", "extraction", "repeated_question", "control")

SIZES: dict[str, dict[str, int]] = {
    # Per workload and run: `conversations` is set by the bench from the batch size.
    "tiny": dict(output_tokens=4, turns=2, shots=1, repeats=2),
    "quick": dict(output_tokens=64, turns=2, shots=3, repeats=2),
    "full": dict(output_tokens=128, turns=3, shots=4, repeats=3),
}


def turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def reply_to(role: str, content: str) -> str:
    """A follow-up segment: closes the model's turn, adds `role`'s, opens the model's."""
    return f"{IM_END}\n{turn(role, content)}{IM_START}assistant\n"


def opening(system: str, user: str, shots: Sequence[tuple[str, str]] = ()) -> str:
    """A conversation's first prompt up to the model's turn (few-shot pairs as turns)."""
    body = "".join(turn("user", q) + turn("assistant", a) for q, a in shots)
    return turn("system", system) + body + turn("user", user) + f"{IM_START}assistant\n"


# ---------------------------------------------------------------- slot lists

CITIES = {  # city: (country, airport code)
    "Lisbon": ("Portugal", "LIS"), "Berlin": ("Germany", "BER"), "Madrid": ("Spain", "MAD"),
    "Boston": ("United States", "BOS"), "Toronto": ("Canada", "YYZ"),
    "Osaka": ("Japan", "KIX"), "Nairobi": ("Kenya", "NBO"), "Lima": ("Peru", "LIM"),
    "Dublin": ("Ireland", "DUB"), "Seoul": ("South Korea", "ICN"),
    "Melbourne": ("Australia", "MEL"), "Oslo": ("Norway", "OSL"),
    "Cairo": ("Egypt", "CAI"), "Denver": ("United States", "DEN"),
    "Zurich": ("Switzerland", "ZRH"), "Mumbai": ("India", "BOM"),
}
FIRST = ("Maria", "James", "Aisha", "Kenji", "Sofia", "Daniel", "Priya", "Lukas", "Elena",
         "Omar", "Grace", "Mateo", "Hannah", "Tomas", "Leila", "Victor", "Nora", "Samuel")
LAST = ("Lopez", "Carter", "Okafor", "Tanaka", "Rossi", "Novak", "Sharma", "Becker",
        "Petrova", "Haddad", "Nguyen", "Silva", "Fischer", "Kowalski", "Moreau", "Ahmed")
JOBS = ("nurse", "civil engineer", "chemistry teacher", "software developer", "pharmacist",
        "architect", "journalist", "electrician", "accountant", "marine biologist",
        "bakery owner", "airline pilot")
EMPLOYERS = ("City General Hospital", "Northwind Logistics", "the public library",
             "Brightwater Energy", "Harbor Street School", "Atlas Engineering",
             "Greenleaf Pharmacy", "the regional newspaper", "Summit Bank",
             "Oceanic Research Institute")
AIRLINES = ("AU", "BX", "LY", "KZ")
PRODUCTS = {"wireless headphones": 89.99, "standing desk": 349.0, "espresso machine": 229.5,
            "running shoes": 119.0, "mechanical keyboard": 74.25, "hiking backpack": 64.0,
            "electric kettle": 39.9, "desk lamp": 27.5}

TOPICS = ("photosynthesis", "the water cycle", "compound interest", "how vaccines work",
          "the causes of the First World War", "black holes", "plate tectonics",
          "the French Revolution", "how a bill becomes law", "machine learning",
          "the immune system", "supply and demand", "the Roman Empire", "climate change",
          "how airplanes fly", "the printing press", "DNA replication", "inflation",
          "the Renaissance", "volcanoes", "the internet", "electric cars",
          "the human heart", "the Industrial Revolution", "solar panels", "earthquakes",
          "the stock market", "antibiotics", "the Moon landing", "coral reefs",
          "the Silk Road", "nuclear energy", "how memory works", "the Cold War",
          "recycling", "tides", "the periodic table", "democracy in ancient Athens",
          "rainbows", "bees and pollination")
ASKS = ("Explain {} in simple terms.", "What should a student know about {}?",
        "Give me a short overview of {}.", "Why is {} important?",
        "Describe {} to a ten-year-old.")
WRITES = ("Write a short story about a {} who finds a map in {}.",
          "Write a poem about a {} spending a rainy afternoon in {}.",
          "Describe a day in the life of a {} living in {}.",
          "Write a letter from a {} to a friend back home in {}.")


# ---------------------------------------------------------------- agent

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["city"]}},
    {"name": "search_flights", "description": "Flights between two airports on a date.",
     "parameters": {"type": "object", "properties": {
         "origin": {"type": "string", "description": "IATA airport code"},
         "destination": {"type": "string", "description": "IATA airport code"},
         "date": {"type": "string", "description": "YYYY-MM-DD"}},
         "required": ["origin", "destination", "date"]}},
    {"name": "book_hotel", "description": "Book a hotel room in a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "check_in": {"type": "string"},
         "nights": {"type": "integer"}}, "required": ["city", "check_in", "nights"]}},
    {"name": "lookup_order", "description": "Status of a customer's order.",
     "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                    "required": ["order_id"]}},
    {"name": "convert_currency", "description": "Convert an amount between currencies.",
     "parameters": {"type": "object", "properties": {
         "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
         "required": ["amount", "from", "to"]}},
]
AGENT_SYSTEM = (
    "You are a travel and shopping assistant. You can call these tools:\n"
    + "\n".join(json.dumps(t) for t in TOOLS)
    + "\n\nTo call a tool, reply with one JSON object "
      '{"name": <tool name>, "arguments": {<argument>: <value>}} and nothing else. '
      "The tool's result comes back as JSON in a message from the tool; then call the next "
      "tool or answer the user, quoting the result's values.")
AGENT_EXAMPLE = (  # one worked exchange, as turns: the default model follows the format only so
    turn("user", "What is the weather in Oslo?")
    + turn("assistant", json.dumps({"name": "get_weather",
                                    "arguments": {"city": "Oslo", "unit": "celsius"}}))
    + turn("tool", json.dumps({"city": "Oslo", "temperature": 3, "unit": "celsius",
                               "conditions": "light snow"}))
    + turn("assistant", "It is 3 degrees celsius in Oslo, with light snow."))


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _trip(rng: random.Random) -> tuple[str, list[dict]]:
    """A user's task and the tool results its calls get, in order."""
    origin, dest = rng.sample(sorted(CITIES), 2)
    date, nights = _date(rng), rng.randint(2, 6)
    kind = rng.randrange(3)
    weather = {"city": dest, "temperature": rng.randint(-5, 32), "unit": "celsius",
               "conditions": rng.choice(["sunny", "cloudy", "light rain", "windy", "clear"])}
    flights = {"origin": CITIES[origin][1], "destination": CITIES[dest][1], "date": date,
               "flights": [{"flight": f"{rng.choice(AIRLINES)}{rng.randint(100, 999)}",
                            "departs": f"{h:02d}:{rng.choice(['05', '20', '45'])}",
                            "price_eur": rng.randint(60, 480)}
                           for h in sorted(rng.sample(range(6, 22), 3))]}
    hotel = {"city": dest, "check_in": date, "nights": nights,
             "hotel": f"Hotel {rng.choice(['Central', 'Riverside', 'Park', 'Harbour'])} {dest}",
             "confirmation": f"HB-{rng.randint(10000, 99999)}",
             "total_eur": nights * rng.randint(70, 210)}
    if kind == 0:
        task = (f"I am flying from {origin} to {dest} on {date}. What will the weather be "
                f"like in {dest}, and which flights are there?")
        return task, [weather, flights, hotel]
    if kind == 1:
        task = (f"Find me a flight from {origin} ({CITIES[origin][1]}) to {dest} "
                f"({CITIES[dest][1]}) on {date} and book a hotel in {dest} for {nights} nights.")
        return task, [flights, hotel, weather]
    product = rng.choice(sorted(PRODUCTS))
    order = {"order_id": f"A{rng.randint(100000, 999999)}", "item": product,
             "price_usd": PRODUCTS[product], "status": rng.choice(["shipped", "in transit",
                                                                   "delivered", "delayed"]),
             "carrier": rng.choice(["DHL", "UPS", "FedEx"]), "expected": _date(rng)}
    converted = {"amount": PRODUCTS[product], "from": "USD", "to": "EUR",
                 "result": round(PRODUCTS[product] * 0.92, 2)}
    task = (f"Where is my order {order['order_id']} (the {product})? And how much is its "
            f"price in euros?")
    return task, [order, converted, weather]


def agent(encode: Encode, seed: int, conversations: int, turns: int,
          output_tokens: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    plans = [_trip(rng) for _ in range(conversations)]
    for t in range(turns):  # listed turn by turn, as `Workload.waves` arrive
        for c, (task, results) in enumerate(plans):
            if t == 0:
                text = (turn("system", AGENT_SYSTEM) + AGENT_EXAMPLE + turn("user", task)
                        + f"{IM_START}assistant\n")
                reqs.append(Request(f"agent-c{c}-t0", tuple(encode(text)), output_tokens, c))
            else:
                text = reply_to("tool", json.dumps(results[(t - 1) % len(results)]))
                reqs.append(Request(f"agent-c{c}-t{t}", tuple(encode(text)), output_tokens, c,
                                    t, parent=f"agent-c{c}-t{t - 1}"))
    return reqs


# ---------------------------------------------------------------- extraction

EXTRACTION_SYSTEM = ("Extract every person in the text as a JSON list of objects with the "
                     'keys "name", "age", "city", "job" and "employer", copying the values '
                     "exactly as written.")
SENTENCES = ("{name}, {age}, moved to {city} and now works as a {job} at {employer}.",
             "In {city}, {name} ({age}) has spent the last few years as a {job} with {employer}.",
             "{employer} hired {name}, a {age}-year-old {job}, for its office in {city}.",
             "{name} is {age} and lives in {city}, where {name_first} is a {job} at {employer}.")


def _people(rng: random.Random, n: int) -> tuple[str, str]:
    """A paragraph about `n` people and its extraction (compact JSON, one line)."""
    people, sentences = [], []
    for first, last in zip(rng.sample(FIRST, n), rng.sample(LAST, n)):
        p = {"name": f"{first} {last}", "age": rng.randint(22, 67),
             "city": rng.choice(sorted(CITIES)), "job": rng.choice(JOBS),
             "employer": rng.choice(EMPLOYERS)}
        people.append(p)
        sentences.append(rng.choice(SENTENCES).format(name_first=first, **p))
    return " ".join(sentences), json.dumps(people)


def extraction(encode: Encode, seed: int, conversations: int, shots: int, output_tokens: int
               ) -> list[Request]:
    rng = random.Random(seed)
    examples = [_people(rng, 2) for _ in range(shots)]
    return [Request(f"extract-{i}", tuple(encode(opening(EXTRACTION_SYSTEM, _people(rng, 3)[0],
                                                         examples))), output_tokens, i)
            for i in range(conversations)]


# ---------------------------------------------------------------- questions

QUESTION_SYSTEM = "You are a helpful assistant. Answer clearly and in detail."


def _questions(rng: random.Random, n: int) -> list[str]:
    """`n` distinct questions (topic x phrasing, in a seeded order)."""
    pool = [ask.format(topic) for topic in TOPICS for ask in ASKS]
    if n > len(pool):
        raise ValueError(f"{n} distinct questions asked of a pool of {len(pool)}")
    return rng.sample(pool, n)


def repeated_question(encode: Encode, seed: int, conversations: int, repeats: int,
                      output_tokens: int) -> list[Request]:
    """`ceil(conversations / repeats)` questions, each asked once first (`turn` 0: the
    deployment's history, see `split_history`), then `conversations` askings more: each
    question `repeats` times, every question once before any again, in seeded orders."""
    rng = random.Random(seed)
    distinct = _questions(rng, -(-conversations // repeats))
    prompts = [tuple(encode(opening(QUESTION_SYSTEM, q))) for q in distinct]
    reqs = [Request(f"ask-q{q}-r0", p, output_tokens, q) for q, p in enumerate(prompts)]
    for r in range(1, repeats + 1):
        order = list(range(len(distinct)))
        rng.shuffle(order)
        for q in order[:conversations - len(reqs) + len(distinct)]:
            reqs.append(Request(f"ask-q{q}-r{r}", prompts[q], output_tokens, q, r))
    return reqs


def control(encode: Encode, seed: int, conversations: int, output_tokens: int
            ) -> list[Request]:
    """Distinct free-form writing prompts, no system prompt: nothing shared but the chat
    markers, nothing asked twice."""
    rng = random.Random(seed)
    pool = [w.format(job, city) for w in WRITES for job in JOBS for city in CITIES]
    return [Request(f"control-{i}", tuple(encode(turn("user", text) + f"{IM_START}assistant\n")),
                    output_tokens, i)
            for i, text in enumerate(rng.sample(pool, conversations))]


def split_history(workload: Workload) -> tuple[Workload | None, Workload]:
    """What a deployment saw before the timed run (`repeated_question`'s first askings,
    `turn` 0), and the timed run; (None, workload) for the other workloads."""
    if workload.name != "repeated_question":
        return None, workload
    seen = tuple(r for r in workload.requests if r.turn == 0)
    timed = tuple(r for r in workload.requests if r.turn > 0)
    return (replace(workload, name=f"{workload.name}_history", requests=seen),
            replace(workload, requests=timed))


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "agent": agent, "extraction": extraction, "repeated_question": repeated_question,
    "control": control,
}


def make_chat_workload(name: str, preset: str, encode: Encode, conversations: int,
                       seed: int = 0, **overrides: int) -> Workload:
    """Workload `name` with `conversations` conversations at `preset`'s sizes (those of
    them `name` takes)."""
    generate = GENERATORS[name]
    takes = inspect.signature(generate).parameters
    settings = {k: v for k, v in {**SIZES[preset], "conversations": conversations,
                                  **overrides}.items() if k in takes}
    return Workload(name, preset, seed, settings, tuple(generate(encode, seed, **settings)))
