"""Multi-turn chat: each turn's prompt extends the previous one, so every turn hits the cache."""
from lang_client import assistant, function, gen, system, user


@function
def multi_turn_chat(s, questions, system_prompt="You are a helpful assistant."):
    s += system(system_prompt)
    for i, question in enumerate(questions):
        s += user(question)
        s += assistant(gen(f"answer_{i}", max_tokens=128))


def main(argv=None):
    from lang_client.examples._cli import setup
    args = setup(__doc__, argv)
    questions = ["Name a prime number above 10.", "Is it odd?", "What is its square?"]
    if args.remote:
        s = multi_turn_chat.run(questions=questions, remote=True)
        print(s.text())
        return
    s = multi_turn_chat.run(questions=questions, stream=True)
    for chunk in s.text_iter():  # the conversation as it is written, turn markers included
        print(chunk, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
