//! The one builder of conditional writes: every UpdateItem the store makes is
//! an [`Update`] (what it sets, removes, adds and deletes, and the condition
//! it is guarded by), and the conditioned puts and deletes borrow its
//! condition. One builder means one place where an expression, its names and
//! its values are put together, so a guard cannot be written without the
//! values it names, and every write reports its consumed capacity the same way.

use super::client::{ConditionFailed, LeaseStore};
use super::codec::{Item, attr, n, pk_of, s};
use super::error::StoreError;
use super::keys::STREAM_PK_PREFIX;
use crate::support::lock;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::delete_item::builders::DeleteItemFluentBuilder;
use aws_sdk_dynamodb::operation::put_item::builders::PutItemFluentBuilder;
use aws_sdk_dynamodb::operation::update_item::{UpdateItemError, UpdateItemOutput};
use aws_sdk_dynamodb::types::{
    AttributeValue, ReturnConsumedCapacity, ReturnValue, ReturnValuesOnConditionCheckFailure,
};
use std::collections::HashMap;
use std::sync::Mutex;

/// A conditional write under construction. Placeholders are chosen by the
/// caller (they read better in a guard than generated ones); a placeholder
/// given twice keeps the last value.
#[derive(Clone, Default)]
pub(super) struct Update {
    set: Vec<String>,
    remove: Vec<&'static str>,
    add: Vec<String>,
    delete: Vec<String>,
    conditions: Vec<String>,
    names: Vec<(&'static str, &'static str)>,
    values: Vec<(String, AttributeValue)>,
}

impl Update {
    pub(super) fn new() -> Self {
        Self::default()
    }

    /// `SET attribute = placeholder`.
    pub(super) fn set(&mut self, attribute: &str, placeholder: &str, value: AttributeValue) {
        self.set_clause(format!("{attribute} = {placeholder}"));
        self.value(placeholder, value);
    }

    /// A SET clause written out (`x = if_not_exists(x, :zero)`); the values it
    /// names are given with [`Update::value`].
    pub(super) fn set_clause(&mut self, clause: impl Into<String>) {
        self.set.push(clause.into());
    }

    /// `REMOVE attribute`.
    pub(super) fn remove(&mut self, attribute: &'static str) {
        self.remove.push(attribute);
    }

    /// `ADD attribute placeholder` (numbers and sets).
    pub(super) fn add(&mut self, attribute: &str, placeholder: &str, value: AttributeValue) {
        self.add.push(format!("{attribute} {placeholder}"));
        self.value(placeholder, value);
    }

    /// `DELETE attribute placeholder` (elements of a set).
    pub(super) fn delete(&mut self, attribute: &str, placeholder: &str, value: AttributeValue) {
        self.delete.push(format!("{attribute} {placeholder}"));
        self.value(placeholder, value);
    }

    /// One more condition; all of them must hold.
    pub(super) fn require(&mut self, condition: impl Into<String>) {
        self.conditions.push(condition.into());
    }

    /// `attribute = placeholder`, or the attribute absent when there is no value.
    pub(super) fn require_equal_or_absent(
        &mut self,
        attribute: &str,
        placeholder: &str,
        value: Option<AttributeValue>,
    ) {
        match value {
            Some(v) => {
                self.require(format!("{attribute} = {placeholder}"));
                self.value(placeholder, v);
            }
            None => self.require(format!("attribute_not_exists({attribute})")),
        }
    }

    /// Numbers that default to 0 may be stored as 0 or not at all.
    pub(super) fn require_equal_or_zero(&mut self, attribute: &str, placeholder: &str, v: u64) {
        if v == 0 {
            self.require(format!(
                "(attribute_not_exists({attribute}) OR {attribute} = {placeholder})"
            ));
        } else {
            self.require(format!("{attribute} = {placeholder}"));
        }
        self.value(placeholder, n(v));
    }

    /// An alias (`#exp`) for an attribute name the expressions use.
    pub(super) fn name(&mut self, alias: &'static str, attribute: &'static str) {
        self.names.push((alias, attribute));
    }

    /// A value the expressions name.
    pub(super) fn value(&mut self, placeholder: &str, value: AttributeValue) {
        self.values.push((placeholder.to_string(), value));
    }

    fn expression(&self) -> String {
        let mut clauses = Vec::new();
        if !self.set.is_empty() {
            clauses.push(format!("SET {}", self.set.join(", ")));
        }
        if !self.remove.is_empty() {
            clauses.push(format!("REMOVE {}", self.remove.join(", ")));
        }
        if !self.add.is_empty() {
            clauses.push(format!("ADD {}", self.add.join(", ")));
        }
        if !self.delete.is_empty() {
            clauses.push(format!("DELETE {}", self.delete.join(", ")));
        }
        clauses.join(" ")
    }

    fn condition(&self) -> Option<String> {
        (!self.conditions.is_empty()).then(|| self.conditions.join(" AND "))
    }

    /// The condition's parts as the SDK's builders take them: expression,
    /// names, values (`None` when there are none, which DynamoDB requires).
    fn guard(&self) -> Guard {
        let names: HashMap<String, String> = self
            .names
            .iter()
            .map(|(alias, attribute)| (alias.to_string(), attribute.to_string()))
            .collect();
        let values: HashMap<String, AttributeValue> = self.values.iter().cloned().collect();
        (
            self.condition(),
            (!names.is_empty()).then_some(names),
            (!values.is_empty()).then_some(values),
        )
    }

    /// The condition (with its names and values) on a PutItem.
    pub(super) fn guard_put(&self, req: PutItemFluentBuilder) -> PutItemFluentBuilder {
        let (condition, names, values) = self.guard();
        req.set_condition_expression(condition)
            .set_expression_attribute_names(names)
            .set_expression_attribute_values(values)
    }

    /// The condition (with its names and values) on a DeleteItem.
    pub(super) fn guard_delete(&self, req: DeleteItemFluentBuilder) -> DeleteItemFluentBuilder {
        let (condition, names, values) = self.guard();
        req.set_condition_expression(condition)
            .set_expression_attribute_names(names)
            .set_expression_attribute_values(values)
    }
}

/// A condition expression with the names and values it uses.
type Guard = (
    Option<String>,
    Option<HashMap<String, String>>,
    Option<HashMap<String, AttributeValue>>,
);

impl LeaseStore {
    /// Sends `update` to the item `pk`, retried inside the store's deadline;
    /// a failed condition is the inner `Err`. Capacity is counted either way
    /// it was reported.
    pub(super) async fn update_item(
        &self,
        operation: &'static str,
        pk: &str,
        update: &Update,
        returning: ReturnValue,
    ) -> Result<Result<UpdateItemOutput, ConditionFailed>, StoreError> {
        Ok(self
            .send_update(operation, pk, update, returning, false)
            .await?
            .map_err(|_| ConditionFailed))
    }

    /// [`LeaseStore::update_item`] that, when the condition fails, also
    /// returns the item as the condition saw it
    /// (`ReturnValuesOnConditionCheckFailure = ALL_OLD`, which DynamoDB does
    /// not charge for): a writer that lost a race learns who won from the
    /// refusal itself instead of a strongly consistent read afterwards (a
    /// request and a read unit per lost race). `None` when the item does not
    /// exist, or the store does not return it (dynalite): read it then.
    pub(super) async fn update_item_or_current(
        &self,
        operation: &'static str,
        pk: &str,
        update: &Update,
        returning: ReturnValue,
    ) -> Result<Result<UpdateItemOutput, Option<Item>>, StoreError> {
        self.send_update(operation, pk, update, returning, true)
            .await
    }

    async fn send_update(
        &self,
        operation: &'static str,
        pk: &str,
        update: &Update,
        returning: ReturnValue,
        current_on_refusal: bool,
    ) -> Result<Result<UpdateItemOutput, Option<Item>>, StoreError> {
        // Every write to a stream item is stamped, so the controller's
        // change feed (the `by_change` index) cannot miss one: a write path
        // added later is stamped too, without knowing about the feed.
        let stamped;
        let update = if pk.starts_with(STREAM_PK_PREFIX) {
            let mut u = update.clone();
            u.set(
                attr::CHANGED_AT_MS,
                ":changed_at",
                n(self.clock().store_now()),
            );
            u.add(attr::CHANGE_SEQ, ":change_one", n(1));
            stamped = u;
            &stamped
        } else {
            update
        };
        let expression = update.expression();
        let (condition, names, values) = update.guard();
        // The item a refusal carried (the last attempt's: a refusal ends the
        // retries).
        let refused_item: Mutex<Option<Item>> = Mutex::new(None);
        let out = self
            .call(operation, Some(pk), || {
                let request = self
                    .client
                    .update_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(pk))
                    .update_expression(&expression)
                    .set_condition_expression(condition.clone())
                    .set_expression_attribute_names(names.clone())
                    .set_expression_attribute_values(values.clone())
                    .return_values(returning.clone())
                    .return_consumed_capacity(ReturnConsumedCapacity::Indexes)
                    .set_return_values_on_condition_check_failure(
                        current_on_refusal.then_some(ReturnValuesOnConditionCheckFailure::AllOld),
                    );
                let refused_item = &refused_item;
                async move {
                    let result = request.send().await;
                    if let Err(SdkError::ServiceError(e)) = &result
                        && let UpdateItemError::ConditionalCheckFailedException(refusal) = e.err()
                    {
                        *lock(refused_item) = refusal.item().cloned();
                    }
                    result
                }
            })
            .await?;
        Ok(match out {
            Ok(o) => {
                self.record_capacity(operation, o.consumed_capacity());
                Ok(o)
            }
            Err(ConditionFailed) => Err(lock(&refused_item).take()),
        })
    }

    /// Puts `item` (its `Pk` in it) under `guard`'s condition, none if it
    /// has none; a failed condition is the inner `Err`.
    pub(super) async fn put_item(
        &self,
        operation: &'static str,
        item: Item,
        guard: &Update,
    ) -> Result<Result<(), ConditionFailed>, StoreError> {
        let pk = pk_of(&item).map(str::to_owned);
        let out = self
            .call(operation, pk.as_deref(), || {
                let req = self
                    .client
                    .put_item()
                    .table_name(&self.table)
                    .set_item(Some(item.clone()))
                    .return_consumed_capacity(ReturnConsumedCapacity::Indexes);
                guard.guard_put(req).send()
            })
            .await?;
        Ok(out.map(|o| self.record_capacity(operation, o.consumed_capacity())))
    }

    /// Deletes the item `pk` under `guard`'s condition, none if it has none;
    /// a failed condition is the inner `Err`.
    pub(super) async fn delete_item(
        &self,
        operation: &'static str,
        pk: &str,
        guard: &Update,
    ) -> Result<Result<(), ConditionFailed>, StoreError> {
        let out = self
            .call(operation, Some(pk), || {
                let req = self
                    .client
                    .delete_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(pk))
                    .return_consumed_capacity(ReturnConsumedCapacity::Indexes);
                guard.guard_delete(req).send()
            })
            .await?;
        Ok(out.map(|o| self.record_capacity(operation, o.consumed_capacity())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clauses_come_in_one_expression_and_conditions_are_all_required() {
        let mut u = Update::new();
        u.set("a", ":a", n(1));
        u.set_clause("b = if_not_exists(b, :zero)");
        u.value(":zero", n(0));
        u.remove("c");
        u.add("d", ":d", n(2));
        u.delete("e", ":e", AttributeValue::Ss(vec!["x".into()]));
        u.require("f = :a");
        u.require_equal_or_absent("g", ":g", None);
        u.require_equal_or_zero("h", ":h", 0);
        assert_eq!(
            u.expression(),
            "SET a = :a, b = if_not_exists(b, :zero) REMOVE c ADD d :d DELETE e :e"
        );
        assert_eq!(
            u.condition().as_deref(),
            Some("f = :a AND attribute_not_exists(g) AND (attribute_not_exists(h) OR h = :h)")
        );
        let named: Vec<&str> = u.values.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(named, [":a", ":zero", ":d", ":e", ":h"]);
    }

    #[test]
    fn an_unconditioned_update_has_no_condition() {
        let mut u = Update::new();
        u.add("roster", ":who", AttributeValue::Ss(vec!["w".into()]));
        assert_eq!(u.condition(), None);
        assert_eq!(u.expression(), "ADD roster :who");
    }
}
