"""Generate the fictional-world corpus and question sets of the RAG QA and agentic search apps.

Everything is invented (people, towns, companies and their attributes), so a model cannot
answer from memory: it has to read the retrieved passages. Deterministic (fixed seed, fixed
name lists): running it again rewrites the same files byte for byte.

    python examples/langgraph_apps/rag_qa/make_data.py

writes, next to this file,
- ``corpus.jsonl``: one short passage per entity ``{"id", "title", "text"}``;
- ``train.jsonl`` / ``heldout.jsonl``: single-fact questions ``{"id", "question", "answer",
  "passage_id", "kind"}`` whose answer is a 1-3 word span of the passage ``passage_id``;

and in ``../agentic_search/``
- ``train.jsonl`` / ``heldout.jsonl``: two-fact questions ("In which town was the founder of
  X born?") with ``"passage_ids"``: the two passages needed, in the order they are needed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240611
HERE = Path(__file__).resolve().parent
SEARCH_DIR = HERE.parent / "agentic_search"
RAG_HELDOUT = 52
SEARCH_HELDOUT = 24

PEOPLE = [
    "Mirela Vostok", "Tobin Harrowgate", "Elsbeth Quorn", "Dario Fenwhistle", "Ysolde Marrick",
    "Caspar Ollenby", "Wren Tallisker", "Oskar Brumley", "Anouk Pettigrove", "Lucan Ferreday",
    "Hesper Dunmoor", "Ivo Castellane", "Rosalind Skerritt", "Teodor Vance-Hale", "Maren Oakhurst",
    "Fennick Aldous", "Juniper Halloway", "Bastian Crewe", "Odile Marchbank", "Piet Ramsgill",
    "Sabra Lindqvist", "Corwin Threlkeld", "Ines Wolstenholme", "Alaric Penhallow",
]
TOWNS = [
    "Quellmoor", "Ashcombe Vale", "Brindleford", "Cray Hollow", "Dunsmere", "Emberwick",
    "Fallowgate", "Greymarsh", "Hollin Cross", "Iverstead", "Jessop Ferry", "Kettlebury",
    "Lowenmoor", "Marrowdale", "Nettlecombe", "Orrinsby",
]
COMPANIES = [
    "Brindlecorp", "Velmora Works", "Quillfeather Ltd", "Stonereach Mills", "Halcyra Foods",
    "Tinderbox Analytics", "Morrowglass", "Pellucid Freight", "Corvane Textiles", "Larkspire Audio",
    "Gannetworth Bank", "Oberlin Kilns", "Rushlight Toys", "Sablewood Brewing", "Thimbleton Press",
    "Wyvernhall Motors",
]
PROFESSIONS = [
    "glassblower", "cartographer", "beekeeper", "clockmaker", "astronomer", "ferryman",
    "bookbinder", "falconer", "luthier", "stonemason", "botanist", "lighthouse keeper",
    "cooper", "tailor", "chemist", "surveyor", "weaver", "brewer", "architect", "sculptor",
    "violinist", "shipwright", "locksmith", "potter",
]
COLOURS = ["teal", "crimson", "ochre", "violet", "amber", "indigo", "saffron", "olive",
           "scarlet", "cobalt", "silver", "emerald"]
INSTRUMENTS = ["cello", "oboe", "harp", "banjo", "accordion", "flute", "trombone", "mandolin",
               "bassoon", "zither", "piano", "clarinet"]
RIVERS = ["Ashby", "Corrow", "Dell", "Fenlow", "Garra", "Hesk", "Ilden", "Marl", "Nye",
          "Orrel", "Pell", "Quarry", "Rindle", "Sallow", "Tarn", "Wend"]
LANDMARKS = ["salt market", "stone bridge", "clock tower", "glass arcade", "lantern festival",
             "cheese fair", "windmills", "copper dome", "rose gardens", "old lighthouse",
             "horse races", "paper mill", "boat races", "cider orchards", "bell foundry",
             "puppet theatre"]
PRODUCTS = ["copper kettles", "paper lanterns", "wool blankets", "bicycle bells", "tinned soup",
            "weather maps", "stained glass", "cargo barges", "linen shirts", "radio speakers",
            "savings bonds", "clay tiles", "wooden trains", "amber ale", "pocket atlases",
            "electric vans"]


def _first(name: str) -> str:
    return name.split()[0]


def build_world(rng: random.Random) -> dict:
    towns = {}
    for town, river, landmark in zip(TOWNS, rng.sample(RIVERS, len(TOWNS)), rng.sample(LANDMARKS, len(TOWNS))):
        towns[town] = {"river": river, "year": str(rng.randint(1100, 1650)), "landmark": landmark}
    people = {}
    for name, profession in zip(PEOPLE, rng.sample(PROFESSIONS, len(PEOPLE))):
        people[name] = {"town": rng.choice(TOWNS), "year": str(rng.randint(1890, 1975)), "profession": profession,
                        "colour": rng.choice(COLOURS), "instrument": rng.choice(INSTRUMENTS)}
    companies = {}
    founders = rng.sample(PEOPLE, len(COMPANIES))
    for company, founder, product in zip(COMPANIES, founders, rng.sample(PRODUCTS, len(COMPANIES))):
        born = int(people[founder]["year"])
        companies[company] = {"founder": founder, "year": str(born + rng.randint(22, 45)),
                              "town": rng.choice(TOWNS), "product": product}
    return {"towns": towns, "people": people, "companies": companies}


def _slug(name: str) -> str:
    return name.lower().replace(" ", "_").replace("-", "_")


def passages(world: dict) -> list[dict]:
    out = []
    for name, p in world["people"].items():
        article = "an" if p["profession"][0] in "aeiou" else "a"
        text = (f"{name} is {article} {p['profession']} who was born in the town of {p['town']} in {p['year']}. "
                f"{_first(name)}'s favourite colour is {p['colour']}, and {_first(name)} plays the {p['instrument']}.")
        out.append({"id": f"person_{_slug(name)}", "title": name, "text": text})
    for town, t in world["towns"].items():
        text = (f"{town} is a town on the {t['river']} river, founded in {t['year']}. "
                f"It is known for its {t['landmark']}.")
        out.append({"id": f"town_{_slug(town)}", "title": town, "text": text})
    for company, c in world["companies"].items():
        text = (f"{company} is a company founded by {c['founder']} in {c['year']}. "
                f"It is based in {c['town']} and makes {c['product']}.")
        out.append({"id": f"company_{_slug(company)}", "title": company, "text": text})
    return out


def single_fact_questions(world: dict) -> list[dict]:
    qs = []

    def add(kind, question, answer, pid):
        qs.append({"question": question, "answer": answer, "passage_id": pid, "kind": kind})

    for name, p in world["people"].items():
        pid = f"person_{_slug(name)}"
        add("person_town", f"In which town was {name} born?", p["town"], pid)
        add("person_year", f"In what year was {name} born?", p["year"], pid)
        add("person_profession", f"What is the profession of {name}?", p["profession"], pid)
        add("person_colour", f"What is the favourite colour of {name}?", p["colour"], pid)
        add("person_instrument", f"Which instrument does {name} play?", p["instrument"], pid)
    for town, t in world["towns"].items():
        pid = f"town_{_slug(town)}"
        add("town_river", f"On which river is {town}?", t["river"], pid)
        add("town_year", f"In what year was the town of {town} founded?", t["year"], pid)
        add("town_landmark", f"What is {town} known for?", t["landmark"], pid)
    for company, c in world["companies"].items():
        pid = f"company_{_slug(company)}"
        add("company_founder", f"Who founded {company}?", c["founder"], pid)
        add("company_year", f"In what year was {company} founded?", c["year"], pid)
        add("company_town", f"In which town is {company} based?", c["town"], pid)
        add("company_product", f"What does {company} make?", c["product"], pid)
    return qs


def two_fact_questions(world: dict) -> list[dict]:
    qs = []

    def add(kind, question, answer, pids):
        qs.append({"question": question, "answer": answer, "passage_ids": pids, "kind": kind})

    for company, c in world["companies"].items():
        cid = f"company_{_slug(company)}"
        founder = world["people"][c["founder"]]
        fid = f"person_{_slug(c['founder'])}"
        add("founder_town", f"In which town was the founder of {company} born?", founder["town"], [cid, fid])
        add("founder_colour", f"What is the favourite colour of the founder of {company}?", founder["colour"], [cid, fid])
        add("founder_instrument", f"Which instrument does the founder of {company} play?", founder["instrument"], [cid, fid])
        add("company_river", f"On which river is the town where {company} is based?",
            world["towns"][c["town"]]["river"], [cid, f"town_{_slug(c['town'])}"])
    for name, p in world["people"].items():
        add("birthplace_river", f"On which river is the town where {name} was born?",
            world["towns"][p["town"]]["river"], [f"person_{_slug(name)}", f"town_{_slug(p['town'])}"])
    return qs


def split(questions: list[dict], heldout: int, rng: random.Random, prefix: str) -> tuple[list[dict], list[dict]]:
    order = list(range(len(questions)))
    rng.shuffle(order)
    held = set(order[:heldout])
    train, test = [], []
    for i, q in enumerate(questions):
        (test if i in held else train).append({"id": f"{prefix}{i:03d}", **q})
    return train, test


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def main() -> None:
    rng = random.Random(SEED)
    world = build_world(rng)
    corpus = passages(world)
    texts = {p["id"]: p["text"] for p in corpus}
    single = single_fact_questions(world)
    # a two-fact question whose answer already sits in the first passage (a company based in
    # its founder's birth town) would need one fact only: leave it out
    double = [q for q in two_fact_questions(world) if q["answer"] not in texts[q["passage_ids"][0]]]
    for q in single:  # every answer is a span of its passage
        assert q["answer"] in texts[q["passage_id"]], q
    for q in double:
        assert q["answer"] in texts[q["passage_ids"][1]], q
    train, heldout = split(single, RAG_HELDOUT, rng, "rag")
    s_train, s_heldout = split(double, SEARCH_HELDOUT, rng, "hop")
    write_jsonl(HERE / "corpus.jsonl", corpus)
    write_jsonl(HERE / "train.jsonl", train)
    write_jsonl(HERE / "heldout.jsonl", heldout)
    write_jsonl(SEARCH_DIR / "train.jsonl", s_train)
    write_jsonl(SEARCH_DIR / "heldout.jsonl", s_heldout)
    print(f"corpus {len(corpus)} passages; rag_qa train {len(train)} heldout {len(heldout)}; "
          f"agentic_search train {len(s_train)} heldout {len(s_heldout)}")


if __name__ == "__main__":
    main()
