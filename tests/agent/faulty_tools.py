"""Tools that misbehave in every way the runner must survive (tests/agent/test_runner.py)."""
import os
import time


def echo(text: str) -> str:
    """Return the text, after printing noise to stdout (which must not reach the protocol).

    Args:
        text: anything
    """
    print("noise on stdout")
    return text


def boom(x: int) -> str:
    """Raise."""
    raise ValueError(f"bad x={x}")


def hang(x: int) -> str:
    """Never return."""
    time.sleep(3600)
    return "unreachable"


def junk(x: int) -> object:
    """Return something that is not text or JSON."""
    return {1, 2, 3}


def hog(mb: int) -> str:
    """Allocate mb MiB."""
    block = bytearray(mb * 1024 * 1024)
    return str(len(block))


def die(x: int) -> str:
    """Exit the process."""
    os._exit(3)


def as_json(x: int) -> dict:
    """Return a JSON value."""
    return {"x": x, "squares": [x * x]}
