import sys


def count(text: str) -> int:
    return len(text.splitlines())


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as file:
        print(count(file.read()))
