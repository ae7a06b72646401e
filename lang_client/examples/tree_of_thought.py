"""Tree of thought: fork plans, fork solutions under each plan, score every solution; pick the best after.

Two levels of forks; every join gathers its branches' variables, so the root ends up with
plan[i], answer[i][j] and score[i][j], locally and remotely alike.
"""
from lang_client import assistant, function, gen, user


def propose_plans(s, question, n, temperature):
    s += user(question + "\nWrite a short high-level plan to solve this. Do not solve it yet.")
    forks = s.fork(n)
    forks += assistant(gen("plan", max_tokens=64, temperature=temperature))
    return forks


def execute_plan(s, n, temperature):
    s += user("The plan looks good. Follow it and give the final answer.")
    forks = s.fork(n)
    forks += assistant(gen("answer", max_tokens=64, temperature=temperature))
    return forks


def score_solution(s):
    s += user("Rate the solution above from 0 to 9. Output only the number.")
    s += assistant(gen("score", dtype=int, max_tokens=2))


@function
def tree_search(s, question, num_branches=2, branch_temperature=0.7):
    plans = propose_plans(s, question, num_branches, branch_temperature)
    for plan in plans:
        solutions = execute_plan(plan, num_branches, branch_temperature)
        for solution in solutions:
            score_solution(solution)
        solutions.join()  # plan gains answer[j], score[j]
    plans.join()          # root gains plan[i], answer[i][j], score[i][j]


def best_solution(state) -> tuple[int, str, str]:
    """(score, plan, answer) of the highest-scored leaf; plain Python over the gathered variables."""
    leaves = []
    for plan, answers, scores in zip(state["plan"], state["answer"], state["score"]):
        for answer, score in zip(answers, scores):
            leaves.append((int(score), plan, answer))
    return max(leaves, key=lambda leaf: leaf[0])


def main(argv=None):
    from lang_client.examples._cli import setup
    args = setup(__doc__, argv)
    s = tree_search.run(question="A farmer has 17 sheep; all but 9 run away. How many are left?",
                        remote=args.remote)
    score, plan, answer = best_solution(s)
    print(f"best (score {score}):\nplan:{plan}\nanswer:{answer}")


if __name__ == "__main__":
    main()
