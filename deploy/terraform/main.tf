# The lease table and the pods' IAM, the same resources as
# deploy/cloudformation.yaml: on-demand billing, the by_holder and by_change
# indexes, TTL on
# departed workers' items, point-in-time recovery, deletion protection, a
# least-privilege policy for tether pods and one for CLI users, and optionally
# the pods' role for IRSA and/or EKS Pod Identity (with its association).

resource "aws_dynamodb_table" "leases" {
  # Encrypted at rest with DynamoDB's AWS managed KMS key (server_side_encryption
  # without kms_key_arn). The items hold stream URLs, lease state and
  # checkpoints, never header values (those stay in Secrets); a customer
  # managed key would also need KMS grants for the pods' role.
  #checkov:skip=CKV_AWS_119:AWS managed KMS key; the table holds no secrets (header values stay in Kubernetes Secrets)
  name                        = var.table_name
  billing_mode                = "PAY_PER_REQUEST"
  hash_key                    = "Pk"
  deletion_protection_enabled = true

  attribute {
    name = "Pk"
    type = "S"
  }

  attribute {
    name = "holder"
    type = "S"
  }

  attribute {
    name = "change_shard"
    type = "S"
  }

  attribute {
    name = "changed_at_ms"
    type = "N"
  }

  global_secondary_index {
    name            = "by_holder"
    hash_key        = "holder"
    projection_type = "INCLUDE"
    non_key_attributes = [
      "desired_state",
      "lease_counter",
      "lease_expires_at_ms",
      "lease_owner",
      "released_at_ms",
      "release_reason",
      "created_at_ms",
      "deleted_at_ms",
      "worker_state",
      "draining_at_ms",
    ]
  }

  global_secondary_index {
    name               = "by_change"
    hash_key           = "change_shard"
    range_key          = "changed_at_ms"
    projection_type    = "INCLUDE"
    non_key_attributes = ["uid", "change_seq", "deleted_at_ms"]
  }

  ttl {
    attribute_name = "expires_at"
    enabled        = true
  }

  point_in_time_recovery {
    enabled = true
  }

  server_side_encryption {
    enabled = true
  }

  lifecycle {
    prevent_destroy = true
  }

  tags = var.tags
}

data "aws_iam_policy_document" "worker" {
  # Conditional writes on stream, worker and checkpoint items; reads of
  # peers' items and read-backs; deletes of departed workers' items and by
  # the controller.
  statement {
    sid = "LeaseItems"
    actions = [
      "dynamodb:GetItem",
      "dynamodb:BatchGetItem",
      "dynamodb:PutItem",
      "dynamodb:UpdateItem",
      "dynamodb:DeleteItem",
      "dynamodb:DescribeTable",
    ]
    resources = [aws_dynamodb_table.leases.arn]
  }

  # Fleet, unowned and dead-owner queries; the controller's change feed
  # (by_state only while a rolling upgrade from 0.1 is under way).
  statement {
    sid     = "Indexes"
    actions = ["dynamodb:Query"]
    resources = [
      "${aws_dynamodb_table.leases.arn}/index/by_holder",
      "${aws_dynamodb_table.leases.arn}/index/by_change",
      "${aws_dynamodb_table.leases.arn}/index/by_state",
    ]
  }

  # The controller's garbage collector scans the stream items once when a
  # replica starts leading (items from before by_change) to find those whose
  # StreamConnection is gone, and queries by_change after that. Any operator
  # pod may become the leader.
  statement {
    sid       = "GarbageCollection"
    actions   = ["dynamodb:Scan"]
    resources = [aws_dynamodb_table.leases.arn]
  }
}

resource "aws_iam_policy" "worker" {
  name   = "${var.table_name}-tether-worker"
  policy = data.aws_iam_policy_document.worker.json
  tags   = var.tags
}

data "aws_iam_policy_document" "cli" {
  # `tether get` lists streams with a scan; `apply` and `delete` write
  # desired state and tombstones with conditions.
  statement {
    sid = "Streams"
    actions = [
      "dynamodb:Scan",
      "dynamodb:GetItem",
      "dynamodb:BatchGetItem",
      "dynamodb:UpdateItem",
      "dynamodb:DescribeTable",
    ]
    resources = [aws_dynamodb_table.leases.arn]
  }
}

resource "aws_iam_policy" "cli" {
  name   = "${var.table_name}-tether-cli"
  policy = data.aws_iam_policy_document.cli.json
  tags   = var.tags
}

data "aws_iam_policy_document" "irsa_trust" {
  count = var.oidc_provider_arn == null ? 0 : 1
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_provider_url}:sub"
      values   = ["system:serviceaccount:${var.service_account_namespace}:${var.service_account_name}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_provider_url}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "irsa" {
  count              = var.oidc_provider_arn == null ? 0 : 1
  name               = "${var.table_name}-tether-irsa"
  description        = "tether pods via IAM roles for service accounts"
  assume_role_policy = data.aws_iam_policy_document.irsa_trust[0].json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "irsa" {
  count      = var.oidc_provider_arn == null ? 0 : 1
  role       = aws_iam_role.irsa[0].name
  policy_arn = aws_iam_policy.worker.arn
}

data "aws_iam_policy_document" "pod_identity_trust" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["pods.eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "pod_identity" {
  count              = var.eks_cluster_name == null ? 0 : 1
  name               = "${var.table_name}-tether-pod-identity"
  description        = "tether pods via EKS Pod Identity"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_trust.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "pod_identity" {
  count      = var.eks_cluster_name == null ? 0 : 1
  role       = aws_iam_role.pod_identity[0].name
  policy_arn = aws_iam_policy.worker.arn
}

resource "aws_eks_pod_identity_association" "tether" {
  count           = var.eks_cluster_name == null ? 0 : 1
  cluster_name    = var.eks_cluster_name
  namespace       = var.service_account_namespace
  service_account = var.service_account_name
  role_arn        = aws_iam_role.pod_identity[0].arn
  tags            = var.tags
}
