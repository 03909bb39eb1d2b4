#!/usr/bin/env python3
"""Offline check of deploy/terraform (no terraform binary can be installed
here): every file parses as HCL2 (python-hcl2, PyPI), every variable used is
declared, and the module creates what deploy/cloudformation.yaml creates with
the same settings: table key, index projection, TTL attribute, deletion
protection, the two policies' actions, the IRSA role and the Pod Identity
association."""

import pathlib
import re
import sys

import hcl2
import yaml

root = pathlib.Path(__file__).resolve().parent.parent
tf_dir = root / "deploy" / "terraform"
blocks = {}
text = ""
for path in sorted(tf_dir.glob("*.tf")):
    source = path.read_text()
    text += source
    parsed = hcl2.loads(source)
    for kind, items in parsed.items():
        blocks.setdefault(kind, []).extend(items)


def resources(type_):
    return {unquote(name): body for r in blocks.get("resource", []) for t, named in r.items()
            if unquote(t) == type_ for name, body in named.items()}


def data(type_):
    return {unquote(name): body for r in blocks.get("data", []) for t, named in r.items()
            if unquote(t) == type_ for name, body in named.items()}


def unquote(v):
    return v.strip('"') if isinstance(v, str) else v


declared = {unquote(name) for v in blocks.get("variable", []) for name in v}
used = set(re.findall(r"var\.([a-z_]+)", text))
assert used <= declared, f"undeclared variables: {used - declared}"


class Cfn(yaml.SafeLoader):
    pass


Cfn.add_multi_constructor("!", lambda loader, suffix, node: None)
cfn = yaml.load((root / "deploy" / "cloudformation.yaml").read_text(), Loader=Cfn)["Resources"]

table = resources("aws_dynamodb_table")["leases"]
cfn_table = cfn["LeaseTable"]["Properties"]
assert unquote(table["hash_key"]) == "Pk"
assert table["deletion_protection_enabled"] is True and cfn_table["DeletionProtectionEnabled"] is True
assert unquote(table["ttl"][0]["attribute_name"]) == cfn_table["TimeToLiveSpecification"]["AttributeName"] == "expires_at"
tf_indexes = table["global_secondary_index"]
cfn_indexes = cfn_table["GlobalSecondaryIndexes"]
assert [unquote(g["name"]) for g in tf_indexes] == [g["IndexName"] for g in cfn_indexes] == ["by_holder", "by_change"]
for gsi, cfn_gsi in zip(tf_indexes, cfn_indexes):
    assert [unquote(a) for a in gsi["non_key_attributes"]] == cfn_gsi["Projection"]["NonKeyAttributes"], "index projections differ"
    tf_keys = [unquote(gsi["hash_key"])] + ([unquote(gsi["range_key"])] if "range_key" in gsi else [])
    assert tf_keys == [k["AttributeName"] for k in cfn_gsi["KeySchema"]], f"{gsi['name']} keys differ"
tf_types = {unquote(a["name"]): unquote(a["type"]) for a in table["attribute"]}
cfn_types = {a["AttributeName"]: a["AttributeType"] for a in cfn_table["AttributeDefinitions"]}
assert tf_types == cfn_types, f"attribute types differ: {tf_types} != {cfn_types}"

docs = data("aws_iam_policy_document")
for tf_name, cfn_name in [("worker", "WorkerPolicy"), ("cli", "CliPolicy")]:
    tf_actions = sorted(unquote(a) for s in docs[tf_name]["statement"] for a in s["actions"])
    cfn_actions = sorted(a for s in cfn[cfn_name]["Properties"]["PolicyDocument"]["Statement"] for a in s["Action"])
    assert tf_actions == cfn_actions, f"{tf_name} policy: {tf_actions} != {cfn_actions}"

assert "irsa" in resources("aws_iam_role") and "IrsaRole" in cfn
assert "tether" in resources("aws_eks_pod_identity_association") and "PodIdentityAssociation" in cfn
print(f"  terraform: {len(list(tf_dir.glob('*.tf')))} files parse; same table, index, TTL, policies and roles as CloudFormation")
