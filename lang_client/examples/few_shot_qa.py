"""Few-shot question answering: a long constant prefix that every question shares (a radix-cache hit)."""
from lang_client import function, gen

EXAMPLES = [
    ("What is the boiling point of water at sea level in Celsius?", "100"),
    ("Which planet is closest to the sun?", "Mercury"),
    ("How many sides does a hexagon have?", "6"),
    ("What gas do plants absorb from the air?", "Carbon dioxide"),
]
FEW_SHOT = "Answer each question with a short phrase.\n\n" + "".join(
    f"Question: {q}\nAnswer: {a}\n\n" for q, a in EXAMPLES)


@function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Question: " + question + "\n"
    s += "Answer:" + gen("answer", max_tokens=32, stop="\n", temperature=0)


def main(argv=None):
    from lang_client.examples._cli import setup
    args = setup(__doc__, argv)
    questions = ["What is the largest ocean on Earth?", "Who wrote Hamlet?", "What is 7 times 8?"]
    # run_batch sends the constant few-shot prefix once before the batch fans out.
    states = few_shot_qa.run_batch([{"question": q} for q in questions], remote=args.remote)
    for q, s in zip(questions, states):
        print(f"{q} ->{s['answer']}")


if __name__ == "__main__":
    main()
