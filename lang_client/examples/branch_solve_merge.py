"""Branch-solve-merge: judge an essay on several dimensions in parallel forks, then merge the judgments."""
from lang_client import assistant, function, gen, select, system, user

DIMENSIONS = ["Clarity", "Originality", "Evidence"]
GRADE_REGEX = r"[ABCD][+-]?"


@function
def multi_dimensional_judge(s, essay, dimensions=DIMENSIONS):
    s += system("You evaluate essays.")
    s += user("Essay: " + essay)
    s += assistant("Sure!")
    s += user("Is the essay on topic?")
    s += assistant(select("on_topic", choices=["yes", "no"]))

    # Every fork shares the conversation so far: one prefill, then the branches decode in parallel.
    forks = s.fork(len(dimensions))
    for f, dim in zip(forks, dimensions):
        f += user("Evaluate the essay on this dimension only: " + dim + ". End with END.")
        f += assistant("Judgment:" + gen("judgment", max_tokens=96, stop="END"))

    # Plain Python string work: traced, each judgment becomes a read of that branch's variable.
    judgments = "".join(f"{dim}:{f['judgment']}\n" for f, dim in zip(forks, dimensions))
    s += user("Merge the judgments below into a summary and a letter grade.\n" + judgments)
    s += assistant("In summary," + gen("summary", max_tokens=96, stop=".") +
                   ". The grade of it is " + gen("grade", max_tokens=4, regex=GRADE_REGEX))


def main(argv=None):
    from lang_client.examples._cli import setup
    args = setup(__doc__, argv)
    essay = "Cities should plant more trees: shade lowers summer temperatures and cuts energy use."
    s = multi_dimensional_judge.run(essay=essay, remote=args.remote)
    print("on topic:", s["on_topic"])
    print("summary:", s["summary"])
    print("grade:", s["grade"])


if __name__ == "__main__":
    main()
