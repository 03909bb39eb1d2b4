variable "table_name" {
  description = "Name of the lease table."
  type        = string
  default     = "tether-streams"
}

variable "service_account_namespace" {
  description = "Namespace of the chart's service account."
  type        = string
  default     = "tether-system"
}

variable "service_account_name" {
  description = "Name of the chart's service account (the release's full name)."
  type        = string
  default     = "tether"
}

variable "oidc_provider_arn" {
  description = "IRSA: ARN of the cluster's IAM OIDC provider; null for no IRSA role."
  type        = string
  default     = null
}

variable "oidc_provider_url" {
  description = "IRSA: the provider's URL without https:// (oidc.eks.REGION.amazonaws.com/id/XXXX)."
  type        = string
  default     = null
}

variable "eks_cluster_name" {
  description = "EKS Pod Identity: cluster name; null for no Pod Identity role and association."
  type        = string
  default     = null
}

variable "tags" {
  description = "Tags on every resource."
  type        = map(string)
  default     = {}
}
