"""Placeholder: written by its owner."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    print("not yet")
    return 2
