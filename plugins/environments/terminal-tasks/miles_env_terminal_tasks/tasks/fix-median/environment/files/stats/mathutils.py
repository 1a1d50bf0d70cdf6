"""Small statistics helpers."""


def mean(values):
    if not values:
        raise ValueError("mean of empty data")
    return sum(values) / len(values)


def median(values):
    if not values:
        raise ValueError("median of empty data")
    n = len(values)
    return values[n // 2]
