output "table_arn" {
  value = aws_dynamodb_table.leases.arn
}

output "worker_policy_arn" {
  value = aws_iam_policy.worker.arn
}

output "cli_policy_arn" {
  value = aws_iam_policy.cli.arn
}

output "irsa_role_arn" {
  description = "Set it as the service account's eks.amazonaws.com/role-arn annotation."
  value       = one(aws_iam_role.irsa[*].arn)
}

output "pod_identity_role_arn" {
  value = one(aws_iam_role.pod_identity[*].arn)
}
