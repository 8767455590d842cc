"""A wrong answer: GPipe's order (every forward, then every backward)."""


def one_f_one_b(p, m):
    return [[("F", mb) for mb in range(m)] + [("B", mb) for mb in reversed(range(m))]
            for _ in range(p)]
