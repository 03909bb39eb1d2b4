#!/usr/bin/env python3
"""Every DynamoDB call a role makes is granted by every IAM policy written for
that role, on the resource it touches.

The calls come from the test suite: scripts/test runs it with
TETHER_DYNAMODB_CALL_LOG set, and the test kit's recorder writes one line per
request (caller, operation, table, index), the caller being the app name tether
sends in its User-Agent (testkit/src/call_log.rs). The policies are read from
deploy/ (CloudFormation, Terraform, iam-policy.json).

  scripts/check-iam.py CALL_LOG_DIR [--deploy DIR]

Fails on a call no policy of its role grants, and when a role made no call at
all (the recorder did not run, so the check would prove nothing). Grants never
used are listed, not failed: some are for rare paths (a departed worker's
item deleted, a lost answer read back) the suite may not reach.
"""

import argparse
import collections
import fnmatch
import json
import pathlib
import sys

import hcl2
import yaml

# Which policies each caller runs under. The admin (`tether table`) and local
# (demo, local-store) callers run under whoever manages the table, not a role
# this project ships.
ROLES = {
    "tether-operator": ["cloudformation:WorkerPolicy", "terraform:worker", "iam-policy.json"],
    "tether-worker": ["cloudformation:WorkerPolicy", "terraform:worker", "iam-policy.json"],
    "tether-cli": ["cloudformation:CliPolicy", "terraform:cli"],
}


def resource_kind(arn):
    """`table` or `index/NAME` for any way the policies spell a table ARN."""
    arn = str(arn)
    if "/index/" in arn:
        return "index/" + arn.split("/index/", 1)[1].rstrip('"}')
    return "table"


def as_list(v):
    return v if isinstance(v, list) else [v]


class Cfn(yaml.SafeLoader):
    pass


# `!GetAtt LeaseTable.Arn` is the table; `!Sub "${LeaseTable.Arn}/index/x"` an index.
Cfn.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_scalar(node)
                          if isinstance(node, yaml.ScalarNode) else None)


def policies(deploy):
    """{policy name: [(actions, resource kinds)]}."""
    found = {}
    cfn = yaml.load((deploy / "cloudformation.yaml").read_text(), Loader=Cfn)["Resources"]
    for name in ("WorkerPolicy", "CliPolicy"):
        found[f"cloudformation:{name}"] = [
            (as_list(s["Action"]), [resource_kind(r) for r in as_list(s["Resource"])])
            for s in cfn[name]["Properties"]["PolicyDocument"]["Statement"] if s["Effect"] == "Allow"]
    tf = {}
    for path in sorted((deploy / "terraform").glob("*.tf")):
        for block in hcl2.loads(path.read_text()).get("data", []):
            for kind, named in block.items():
                if kind.strip('"') == "aws_iam_policy_document":
                    tf.update({n.strip('"'): body for n, body in named.items()})
    for name in ("worker", "cli"):
        found[f"terraform:{name}"] = [
            ([a.strip('"') for a in s["actions"]], [resource_kind(r) for r in s["resources"]])
            for s in tf[name]["statement"]]
    doc = json.loads((deploy / "iam-policy.json").read_text())
    found["iam-policy.json"] = [
        (as_list(s["Action"]), [resource_kind(r) for r in as_list(s["Resource"])])
        for s in doc["Statement"] if s["Effect"] == "Allow"]
    return found


def grants(statements, action, resource):
    return any(any(fnmatch.fnmatchcase(action, a) for a in actions)
               and any(fnmatch.fnmatchcase(resource, r) for r in resources)
               for actions, resources in statements)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls", type=pathlib.Path)
    parser.add_argument("--deploy", type=pathlib.Path,
                        default=pathlib.Path(__file__).resolve().parent.parent / "deploy")
    args = parser.parse_args()

    calls = collections.defaultdict(collections.Counter)
    for path in sorted(args.calls.glob("*.tsv")):
        for line in path.read_text().splitlines():
            caller, operation, _table, index = (line.split("\t") + ["-"] * 4)[:4]
            if operation == "-":
                continue
            resource = "table" if index == "-" else f"index/{index}"
            calls[caller][(f"dynamodb:{operation}", resource)] += 1
    known = policies(args.deploy)
    failures = []
    for caller, names in ROLES.items():
        made = calls.get(caller)
        if not made:
            failures.append(f"{caller}: no DynamoDB call recorded (was {args.calls} filled by the suite?)")
            continue
        summary = ", ".join(f"{a.split(':')[1]} {r} ×{n}" for (a, r), n in sorted(made.items()))
        print(f"  {caller}: {summary}")
        for name in names:
            for (action, resource), n in sorted(made.items()):
                if not grants(known[name], action, resource):
                    failures.append(f"{name} does not grant {action} on {resource}, which "
                                    f"{caller} called {n} times")
            used = {a for a, _ in made}
            unused = sorted({a for actions, _ in known[name] for a in actions} - used)
            if unused and caller == "tether-operator":
                print(f"    {name}: granted but not called in this run: {', '.join(unused)}")
    for caller in sorted(set(calls) - set(ROLES)):
        print(f"  {caller}: not checked (no shipped role): {sum(calls[caller].values())} calls")
    if failures:
        print("IAM policies do not cover the calls:", *failures, sep="\n  ")
        sys.exit(1)
    print("  every recorded call is granted by its role's policies")


if __name__ == "__main__":
    main()
