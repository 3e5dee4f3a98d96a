"""The text raylane's demo tokenizer is trained on, written for the project.

Templates filled from word lists with a seeded RNG, plus a few hand-written paragraphs, give about
300 KB of prose, chat-style Q&A, tool calls, Python/JS code, arithmetic reasoning, JSON, logs and
non-ASCII text. The mix decides which merges the 4k-token BPE learns, so serving-shaped text
(chat turns, code, tool-call JSON, numbers) tokenizes into reasonably short sequences; anything
else still encodes, byte by byte at worst. The word lists are long because BPE can only learn as
many merges as the corpus has distinct words to build.
"""

import json
import random
from collections.abc import Callable, Iterator

SEED = 20240601


def words(text: str) -> list[str]:
    return text.split()


NAMES = words("Ada Grace Linus Maya Omar Priya Chen Sofia Kwame Elena Noah Yuki Lucas Amara Mateo Ingrid")
CITIES = words("Paris Tokyo Nairobi Lima Oslo Mumbai Toronto Berlin Seoul Madrid Cairo Sydney Denver Lagos")
NOUNS = words("""
time year people way day world life hand part place case week company system program question work number
night point home water room mother area money story fact month book eye job word business issue side kind
head house service friend father power hour game line end member law car city community name team minute
idea body information parent face level office door health person art history party result change morning
reason research moment air teacher force education foot age policy process music market sense nation plan
college interest experience effect class control care field development role effort rate heart show leader
light voice mind price report decision view relationship town road arm difference value building action model
season society director position player record paper space ground form event center site project activity star
table court situation cost industry figure street image phone data picture practice piece land product doctor
wall patient worker news test movie support technology step baby computer type attention film tree source
organization window evidence population camera bank energy island forest ocean cloud engine kernel thread
buffer packet token vector matrix gradient tensor network database query schema cache queue scheduler replica
cluster router gateway deployment container pipeline library compiler function variable string integer module
package request response header payload endpoint timeout latency throughput memory storage disk processor
battery keyboard screen planet galaxy molecule protein cell seed flower river mountain valley desert bridge
castle kitchen garden lantern notebook bicycle letter melody kettle recipe experiment signal budget harbor
village journey winter summer autumn breakfast dinner coffee bread cheese apple orange lemon sugar salt pepper
carrot potato tomato onion chicken horse dog cat bird fish rabbit fox wolf bear lion tiger elephant whale
dolphin turtle butterfly umbrella ladder blanket candle mirror pillow basket bottle hammer needle ribbon
""")
ADJECTIVES = words("""
good new first last long great little own other old right big high different small large next early young
important few public bad same able real recent certain free full special easy clear strong possible whole
major better hard best true economic local late social simple political final main sure wrong private past
foreign fine common poor natural significant similar hot central happy serious ready physical general
financial blue dark various entire close legal cold medical green nice huge popular traditional cultural wide
modern open quiet bright careful ancient sudden patient narrow warm curious broken gentle crowded strange
reliable heavy quick slow soft loud fresh empty rich thin thick sharp smooth rough deep shallow tiny enormous
famous hidden silent golden silver wooden distant nearby efficient robust scalable concurrent distributed
parallel optional required invalid deprecated experimental stable secure fast expensive cheap friendly honest
brave calm proud lazy busy tired hungry lucky clever wise polite purple yellow orange red white black
""")
# Regular verbs only, so inflect() can build their forms; a few need a doubled final consonant.
VERBS = words("""
walk talk open start finish help want need like love hate play work call ask answer look watch listen learn
study try use move live believe happen include continue change follow create provide allow add remember
consider appear wait serve send expect stay reach remain suggest raise pass require report decide pull return
explain hope develop carry receive agree support produce occur accept compare measure train deploy route
schedule allocate compute cache balance retry stream parse render compile install configure restart upgrade
monitor record paint repair describe share test count question rebuild clean cook bake plant visit travel
climb jump smile laugh cry dance enjoy discover explore imagine notice prepare protect improve increase reduce
collect connect deliver design enter fill fix handle join mention miss offer order pick place print push
realize reject rely replace request save search solve store touch turn update vote wish worry wonder load
check sort filter merge launch stop plan drop ship chat step admit
""")
DOUBLED = {"stop", "plan", "drop", "ship", "chat", "step", "admit"}
ADVERBS = words("""
quickly slowly carefully quietly again soon often never always sometimes usually rarely already almost
finally suddenly gently clearly simply really nearly probably perhaps certainly honestly loudly happily sadly
eagerly patiently recently together everywhere tomorrow yesterday today later
""")
PARAGRAPHS = [
    "The bakery on the corner opens at six. By half past, there is a line out the door: nurses coming "
    "off the night shift, students with headphones, a man who orders the same rye loaf every day and "
    "never says more than thank you. The owner knows all of them by their orders, not their names.",
    "When the river flooded in the spring, the village moved its market to the hill behind the church. "
    "Nobody planned it; people simply carried their tables up the path, and by noon the stalls were "
    "selling bread, honey and dry socks as if nothing had happened.",
    "Our on-call rotation changes every Monday at 10:00 UTC. If an alert fires, acknowledge it within "
    "five minutes, open an incident channel, and write down what you observe before you change "
    "anything. Most outages are made worse by a fix that nobody recorded.",
    "To make a simple tomato sauce, warm olive oil in a wide pan, add two cloves of sliced garlic and "
    "let them turn golden. Pour in the tomatoes, season with salt, and simmer for twenty minutes, "
    "stirring now and then. Finish with a few torn basil leaves.",
    "Light from the Sun takes a little over eight minutes to reach the Earth. When you look at the "
    "night sky, you see every star as it was when its light left, which for some of them was thousands "
    "of years ago.",
    "Dear team, thanks for a productive quarter. We shipped the new scheduler, cut median latency by a "
    "third, and closed more bugs than we opened. Next quarter we will focus on reliability: fewer "
    "pages, faster rollbacks, and better dashboards. Best regards, Elena",
    "Changelog\n\n## 0.4.0\n- Added priority tiers to the router.\n- Fixed a crash when a request was "
    "aborted during prefill.\n- Deprecated the `max_batch` option; use `max_num_seqs` instead.\n\n## "
    "0.3.2\n- Faster startup when loading sharded checkpoints.",
    "Meeting notes (Thursday)\nAttendees: Omar, Priya, Chen\n1. Capacity: the coding pool runs hot "
    "after lunch; add two replicas.\n2. The fallback from reasoning to chat works, but clients cannot "
    "tell; add a header.\nAction items: Omar drafts the proposal, Chen reviews it by Friday.",
    "A good question is worth more than a quick answer. Before you ask, write down what you tried, "
    "what you expected, and what happened instead. Half the time, writing it down is enough to find "
    "the mistake.",
    "The trail climbs steadily through pine forest for the first three kilometers, then opens onto a "
    "ridge with views of the whole valley. Bring water, a warm layer and a map; the weather changes "
    "fast above the trees.",
    "In 1843, Ada Lovelace published notes on Babbage's Analytical Engine, including a method for "
    "computing Bernoulli numbers. Many people call it the first computer program, written for a "
    "machine that was never finished.",
    "Roses are red, the logs are all green,\nthe cluster is calm, the dashboards are clean.\nBut "
    "somewhere a replica quietly sighs,\nits queue growing long as the latency climbs.",
]
NON_ASCII = [
    "Café au lait, crème brûlée et pâtisseries : le déjeuner était très réussi.",
    "¿Dónde está la estación? Mañana vamos a Córdoba con el niño.",
    "Die Brücke über den Fluss ist schön, aber die Straße dorthin ist gesperrt. Grüße aus Köln!",
    "São Paulo é a maior cidade do Brasil; a população é enorme.",
    "Zażółć gęślą jaźń. Dziękuję bardzo!",
    "Ελληνικά: καλημέρα κόσμε. Русский: привет, мир!",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "机器学习模型需要大量的数据和计算资源。",
    "こんにちは、世界。東京は今日も晴れです。",
    "안녕하세요, 만나서 반갑습니다.",
    "مرحبا بالعالم. שלום עולם. नमस्ते दुनिया।",
    "Emoji check: 🚀 launch, 🎉 party, 👍 ok, ❤️ love, 🤖 robot, 🌍 world, ☕ coffee.",
    "Temperatures: −5 °C to 30 °C; price: 12,50 € or £9.99 or ¥1500; π ≈ 3.14159, √2 ≈ 1.414.",
    "Naïve coöperation at the café: résumé, fiancée, jalapeño, smörgåsbord, façade.",
]
TOPICS = {
    "photosynthesis": "Plants use sunlight, water and carbon dioxide to make sugar and release oxygen.",
    "a hash table": "It maps keys to slots with a hash function, so lookups take constant time on average.",
    "tensor parallelism": "Each GPU holds a slice of every weight matrix, and partial results are summed "
    "with an all-reduce.",
    "the water cycle": "Water evaporates, condenses into clouds and falls again as rain or snow.",
    "recursion": "A function calls itself on a smaller input until it reaches a base case.",
    "a load balancer": "It spreads incoming requests across several servers so no single one is overloaded.",
    "inflation": "Prices rise over time, so the same amount of money buys a little less each year.",
    "a KV cache": "The keys and values of past tokens are stored, so each new token attends to them without "
    "recomputing them.",
    "gravity": "Masses attract each other; near the Earth, objects fall with an acceleration of 9.8 m/s².",
    "binary search": "Compare with the middle element and discard the half that cannot hold the target.",
}


def plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "es" if noun.endswith(("s", "sh", "ch", "x")) else noun + "s"


def inflect(verb: str) -> dict[str, str]:
    """Third person, past and -ing forms of a regular verb."""
    stem = verb + verb[-1] if verb in DOUBLED else verb
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return {"s": verb[:-1] + "ies", "ed": verb[:-1] + "ied", "ing": verb + "ing"}
    if verb.endswith("e"):
        return {"s": verb + "s", "ed": verb + "d", "ing": verb[:-1] + "ing"}
    return {"s": plural(verb), "ed": stem + "ed", "ing": stem + "ing"}


def fill(rng: random.Random) -> dict[str, str | int]:
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    return {
        "who": rng.choice(NAMES),
        "who2": rng.choice(NAMES),
        "noun": noun,
        "nouns": plural(noun),
        "noun2": rng.choice(NOUNS),
        "adj": rng.choice(ADJECTIVES),
        "adj2": rng.choice(ADJECTIVES),
        "adv": rng.choice(ADVERBS),
        "city": rng.choice(CITIES),
        "n": rng.randint(2, 40),
        "verb": verb,
        **{f"verb_{form}": word for form, word in inflect(verb).items()},
    }


SENTENCES = [
    "{who} {verb_ed} the {adj} {noun} in {city} {adv}.",
    "In {city}, the {adj} {noun} was {verb_ed} by {who}.",
    "Nobody expected that {who} would {verb} a {noun} so {adv}.",
    '"Is this the {noun} you {verb_ed}?" asked {who}. "It looks {adj}."',
    "After {n} days, the {noun} still seemed {adj}; {who} wrote it down.",
    "The {adj} {noun} and the {adj2} {noun2} were {verb_ed} {adv}, which surprised everyone.",
    "{who} {verb_s} every {noun} before {who2} arrives.",
    "Why are they {verb_ing} the {noun2} instead of the {noun}?",
    "If you {verb} the {noun} now, the {noun2} will be {adj} tomorrow.",
    "Most {nouns} are {adj}, but this one is {adj2}.",
    "{who} was {verb_ing} a {adj} {noun} when {who2} called from {city}.",
    "We should never {verb} a {noun} that is already {adj}.",
    "There were {n} {adj} {nouns} near the {noun2}, and {who} counted each of them.",
    "Her {noun} is more {adj} than his {noun2}, or so {who} says.",
]


def prose(rng: random.Random) -> str:
    return " ".join(rng.choice(SENTENCES).format(**fill(rng)) for _ in range(rng.randint(3, 8)))


def paragraph(rng: random.Random) -> str:
    return rng.choice(PARAGRAPHS)


def chat(rng: random.Random) -> str:
    w = fill(rng)
    if rng.random() < 0.5:
        topic, answer = rng.choice(list(TOPICS.items()))
        question = rng.choice(
            [
                "Can you explain {t} in simple terms?",
                "What is {t}?",
                "How does {t} work?",
                "Why does {t} matter?",
            ]
        ).format(t=topic)
    else:
        question = "How do I {verb} a {adj} {noun}?".format(**w)
        answer = (
            "1. First, {verb} the {noun} {adv}.\n2. Check that the {noun2} is {adj2}.\n3. If it is not, "
            "ask {who} for help."
        ).format(**w)
    opener = rng.choice(["Sure!", "Of course.", "Good question.", "Here is a short explanation:", ""])
    system = rng.choice(["You are a helpful assistant.", "You are a concise tutor.", "Answer briefly."])
    return f"system\n{system}\nuser\n{question}\nassistant\n{opener} {answer}".strip()


def tool_call(rng: random.Random) -> str:
    city, unit = rng.choice(CITIES), rng.choice(["celsius", "fahrenheit"])
    call = rng.choice(
        [
            {"name": "get_weather", "arguments": {"city": city, "unit": unit}},
            {
                "name": "search_web",
                "arguments": {"query": f"flights to {city}", "max_results": rng.randint(1, 10)},
            },
            {"name": "add_calendar_event", "arguments": {"title": "Team sync", "day": rng.randint(1, 28)}},
            {"name": f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}", "arguments": {"id": rng.randint(1, 999)}},
        ]
    )
    result = {"city": city, "temperature": rng.randint(-10, 35), "unit": unit, "ok": True}
    return (
        f"user\nWhat's the weather in {city}?\nassistant\n<tool_call>\n{json.dumps(call)}\n</tool_call>\n"
        f"tool\n{json.dumps(result)}\nassistant\nIt is {result['temperature']} degrees in {city}."
    )


def python_code(rng: random.Random) -> str:
    w = fill(rng)
    func, var, cls = f"{w['verb']}_{w['noun']}", w["nouns"], f"{w['adj'].title()}{w['noun'].title()}"
    n, noun, noun2, adj = w["n"], w["noun"], w["noun2"], w["adj"]
    snippets = [
        [
            f"def {func}({var}: list[int]) -> int:",
            f'    """Return how many {var} are {adj}."""',
            "    result = 0",
            f"    for x in {var}:",
            f"        if x > {n}:",
            "            result += x",
            "    return result",
        ],
        [
            f"class {cls}:",
            f"    def __init__(self, size: int = {n}) -> None:",
            "        self.size = size",
            f"        self._{noun2}s: dict[str, int] = {{}}",
            "",
            f"    def {func}(self, key: str) -> int | None:",
            f"        return self._{noun2}s.get(key)",
        ],
        [
            "import json",
            "",
            f'with open("{noun}.json") as f:',
            "    data = json.load(f)",
            f'print([row["{noun2}"] for row in data if row.get("{adj}")])',
        ],
        [
            f"async def {func}(session, url):",
            f"    async with session.get(url, timeout={n}) as r:",
            "        r.raise_for_status()",
            "        return await r.json()",
        ],
        [
            f"for i in range({n}):",
            "    if i % 3 == 0:",
            "        continue",
            f'    print(f"{noun} {{i}}: {{i * i}}")',
        ],
        [
            f'@pytest.mark.parametrize("{noun}", [1, 2, {n}])',
            f"def test_{func}({noun}):",
            f"    assert {func}([{noun}]) >= 0",
        ],
    ]
    return "\n".join(rng.choice(snippets)) + "\n"


def js_code(rng: random.Random) -> str:
    w = fill(rng)
    name, n, noun = w["verb"] + w["noun"].title() + w["noun2"].title(), w["n"], w["noun"]
    snippets = [
        [
            f"function {name}(items) {{",
            f"  return items.filter((x) => x.{noun} > {n}).map((x) => x.name);",
            "}",
        ],
        [
            f"const {name} = async (id) => {{",
            f"  const res = await fetch(`/api/{noun}s/${{id}}`);",
            '  if (!res.ok) throw new Error("HTTP " + res.status);',
            "  return res.json();",
            "};",
        ],
        [
            f"export class {w['adj'].title()}{noun.title()} {{",
            f"  constructor(size = {n}) {{",
            "    this.size = size;",
            "  }",
            "}",
        ],
        [
            "let count = 0;",
            f'document.querySelector("#{noun}").addEventListener("click", () => {{',
            "  count += 1;",
            f"  console.log(`{w['verb_ed']} ${{count}} times`);",
            "});",
        ],
    ]
    return "\n".join(rng.choice(snippets)) + "\n"


def math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 12)
    return rng.choice(
        [
            f"Question: What is {a} + {b} * {c}?\nReasoning: Multiplication comes first, so "
            f"{b} * {c} = {b * c}. Then {a} + {b * c} = {a + b * c}.\nAnswer: {a + b * c}",
            f"A shop sells pens at ${c} each. If {rng.choice(NAMES)} buys {b} pens, that costs {b} × {c} = "
            f"${b * c}. Starting with ${a + b * c}, there is ${a} left.",
            f"Let x be the number. Then {c}x + {b} = {c * a + b}, so {c}x = {c * a}, and x = {a}.",
            f"Step 1: {a} - {b} = {a - b}.\nStep 2: {a - b} / {c} = {(a - b) / c:.3f}.\n"
            f"Therefore the result is approximately {(a - b) / c:.2f}.",
            f"The area of a {b} m by {c} m rectangle is {b * c} m²; its perimeter is {2 * (b + c)} m.",
            f"Is {a} divisible by {c}? {a} = {c} × {a // c} + {a % c}, so the remainder is {a % c} "
            f"and the answer is {'yes' if a % c == 0 else 'no'}.",
        ]
    )


def json_snippet(rng: random.Random) -> str:
    record = {
        "id": rng.randint(1, 10_000),
        "name": rng.choice(NAMES),
        "city": rng.choice(CITIES),
        "active": rng.random() < 0.5,
        "score": round(rng.random() * 100, 2),
        "tags": rng.sample(ADJECTIVES, k=rng.randint(0, 3)),
        rng.choice(NOUNS): None,
    }
    return json.dumps(record, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.3)


def log_line(rng: random.Random) -> str:
    w = fill(rng)
    level = rng.choice(["INFO", "INFO", "WARNING", "ERROR", "DEBUG"])
    return (
        f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
        f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z {level} {w['noun']}: {w['verb_ed']} "
        f"{w['noun2']} in {rng.randint(1, 999)} ms (replica={rng.randint(0, 7)}, pool={w['adj']})"
    )


def non_ascii(rng: random.Random) -> str:
    return " ".join(rng.sample(NON_ASCII, k=rng.randint(1, 3)))


# Relative weights: mostly prose and chat, like serving traffic, with enough code, math and JSON.
GENERATORS: list[tuple[Callable[[random.Random], str], int]] = [
    (prose, 8),
    (paragraph, 2),
    (chat, 5),
    (tool_call, 2),
    (python_code, 3),
    (js_code, 2),
    (math, 3),
    (json_snippet, 2),
    (log_line, 2),
    (non_ascii, 2),
]


def corpus(num_docs: int = 1500, seed: int = SEED) -> Iterator[str]:
    """Yield `num_docs` documents; the same arguments always give the same text."""
    rng = random.Random(seed)
    funcs, weights = zip(*GENERATORS, strict=True)
    for _ in range(num_docs):
        yield rng.choices(funcs, weights=weights)[0](rng)
