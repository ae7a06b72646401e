"""Structured extraction: the server constrains the output to a regex, so the JSON always parses."""
import json

from lang_client import function, gen

CITY_REGEX = (r'\{"name": "[\w ]{1,32}", "country": "[\w ]{1,32}", '
              r'"population": (0|[1-9][0-9]{0,9}), "is_capital": (true|false)\}')


@function
def extract_city(s, document):
    s += "Extract facts about the city described below as JSON.\n\nText: " + document + "\n\nJSON: "
    s += gen("city", max_tokens=128, regex=CITY_REGEX)
    s += "\nYear founded: " + gen("founded", dtype=int, max_tokens=8)


def main(argv=None):
    from lang_client.examples._cli import setup
    args = setup(__doc__, argv)
    doc = ("Lyon, in France, has about 520000 inhabitants. It was founded by the Romans in 43 BC "
           "and is not the capital.")
    s = extract_city.run(document=doc, remote=args.remote)
    print(json.loads(s["city"]), "founded:", s["founded"])


if __name__ == "__main__":
    main()
