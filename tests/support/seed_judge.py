"""The judge program of the paper's opening example, as written in ../shared/seeds/000_ae93e2ae4df39a4a.txt
(section 2.1): `multi_dimensional_judge` with `dimensions` a module global. `judge_with_image` keeps the
image line (a text-only model must refuse it before generating); `multi_dimensional_judge` drops it and is
otherwise the seed's text."""
from lang_client import assistant, function, gen, image, select, system, user

dimensions = ["Clarity", "Originality", "Evidence"]


@function
def multi_dimensional_judge(s, path, essay):
    s += system("Evaluate an essay about an image.")
    s += user("Essay:" + essay)
    s += assistant("Sure!")

    s += user("Is the essay related to the image?")
    s += assistant(select("related", choices=["yes", "no"]))
    if s["related"] == "no": return

    forks = s.fork(len(dimensions))
    for f, dim in zip(forks, dimensions):
        f += user("Evaluate based on the following dimension:" + dim + ".")
        f += assistant("Judgment:" + gen("judgment", stop="END"))

    judgment = "\n".join(f["judgment"] for f in forks)
    s += user("Provide the judgment, summary, and a letter grade")
    s += assistant(judgment + "In summary," + gen("summary", stop=".") +
                   "The grade of it is" + gen("grade"))

    schema = r'\{"summary": "[\w\d\s]+\.", "grade": "[ABCD][+-]?"\}'
    s += assistant(gen("output", regex=schema))


@function
def judge_with_image(s, path, essay):
    s += system("Evaluate an essay about an image.")
    s += user(image(path) + "Essay:" + essay)
    s += assistant("Sure!")
    s += user("Is the essay related to the image?")
    s += assistant(select("related", choices=["yes", "no"]))
