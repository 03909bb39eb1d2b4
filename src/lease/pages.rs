//! Paginated reads: one loop over `LastEvaluatedKey` for every query and scan.

use super::client::LeaseStore;
use super::codec::{Item, n, s};
use super::error::StoreError;
use aws_sdk_dynamodb::types::ReturnConsumedCapacity;
use std::future::Future;

/// One page: its items and where the next one starts.
pub(super) struct Page {
    pub items: Vec<Item>,
    pub next: Option<Item>,
}

/// A key condition on one index partition, optionally on its sort key too.
pub(super) struct PartitionQuery<'a> {
    pub operation: &'static str,
    pub index: &'a str,
    pub partition_attr: &'a str,
    pub partition: &'a str,
    /// `(sort key attribute, "< :below")`-style restriction.
    pub sort_below: Option<(&'a str, u64)>,
    /// `(sort key attribute, "> :above")`-style restriction.
    pub sort_above: Option<(&'a str, u64)>,
}

impl LeaseStore {
    /// Every item `fetch` returns, page after page.
    pub(super) async fn collect_pages<F, Fut>(&self, mut fetch: F) -> Result<Vec<Item>, StoreError>
    where
        F: FnMut(Option<Item>) -> Fut,
        Fut: Future<Output = Result<Page, StoreError>>,
    {
        let mut items = Vec::new();
        let mut start = None;
        loop {
            let page = fetch(start.take()).await?;
            items.extend(page.items);
            match page.next {
                Some(k) if !k.is_empty() => start = Some(k),
                _ => return Ok(items),
            }
        }
    }

    /// Every item of one index partition (eventually consistent: callers treat
    /// the result as candidates and let a conditional write decide).
    pub(super) async fn query_partition(
        &self,
        q: PartitionQuery<'_>,
    ) -> Result<Vec<Item>, StoreError> {
        Ok(self.query_partition_from(q, None, None).await?.0)
    }

    /// The items of one index partition from just after `start` (the whole
    /// key, which need not exist), at most `limit` of them: the items, and
    /// whether the read reached the partition's end.
    pub(super) async fn query_partition_from(
        &self,
        q: PartitionQuery<'_>,
        start: Option<Item>,
        limit: Option<usize>,
    ) -> Result<(Vec<Item>, bool), StoreError> {
        let condition = match (q.sort_below, q.sort_above) {
            (Some(_), _) => "#p = :p AND #s < :below",
            (None, Some(_)) => "#p = :p AND #s > :above",
            (None, None) => "#p = :p",
        };
        let mut items = Vec::new();
        let mut start = start;
        loop {
            let wanted = limit.map(|l| l.saturating_sub(items.len()));
            let page_limit = match (wanted, self.page_size) {
                (Some(w), Some(p)) => Some(p.min(i32::try_from(w).unwrap_or(i32::MAX))),
                (Some(w), None) => Some(i32::try_from(w).unwrap_or(i32::MAX)),
                (None, p) => p,
            };
            let mut request = self
                .client
                .query()
                .table_name(&self.table)
                .index_name(q.index)
                .key_condition_expression(condition)
                .expression_attribute_names("#p", q.partition_attr)
                .expression_attribute_values(":p", s(q.partition))
                .set_exclusive_start_key(start.take())
                .set_limit(page_limit)
                .return_consumed_capacity(ReturnConsumedCapacity::Total);
            if let Some((sort, below)) = q.sort_below {
                request = request
                    .expression_attribute_names("#s", sort)
                    .expression_attribute_values(":below", n(below));
            } else if let Some((sort, above)) = q.sort_above {
                request = request
                    .expression_attribute_names("#s", sort)
                    .expression_attribute_values(":above", n(above));
            }
            let out = self
                .call_plain(q.operation, None, || request.clone().send())
                .await?;
            self.record_reads(q.operation, out.consumed_capacity());
            // Moved out of the answer, not copied: a takeover's reads return
            // thousands of items.
            items.extend(out.items.unwrap_or_default());
            match out.last_evaluated_key {
                Some(k) if !k.is_empty() => {
                    if limit.is_some_and(|l| items.len() >= l) {
                        return Ok((items, false));
                    }
                    start = Some(k);
                }
                _ => return Ok((items, true)),
            }
        }
    }

    /// Every base-table item whose `Pk` starts with `prefix`: a scan, for the
    /// CLI and administration only, never for a worker's hot path.
    pub(super) async fn scan_prefix(
        &self,
        operation: &'static str,
        prefix: &str,
    ) -> Result<Vec<Item>, StoreError> {
        self.collect_pages(|start| async move {
            let out = self
                .call_plain(operation, None, || {
                    self.client
                        .scan()
                        .table_name(&self.table)
                        .filter_expression("begins_with(#pk, :prefix)")
                        .expression_attribute_names("#pk", super::codec::attr::PK)
                        .expression_attribute_values(":prefix", s(prefix))
                        .set_exclusive_start_key(start.clone())
                        .set_limit(self.page_size)
                        .return_consumed_capacity(ReturnConsumedCapacity::Total)
                        .send()
                })
                .await?;
            self.record_reads(operation, out.consumed_capacity());
            Ok(Page {
                items: out.items.unwrap_or_default(),
                next: out.last_evaluated_key,
            })
        })
        .await
    }
}
