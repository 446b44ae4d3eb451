//! The responses a provider keeps for OpenAI's Responses API (`store: true`,
//! the default): `GET /v1/responses/{id}` returns one, `DELETE` forgets it,
//! and `previous_response_id` continues its conversation, so the model sees
//! the earlier turns' input and output again (OpenAI, `instructions`: "not
//! carried over" through `previous_response_id`; each turn's instructions
//! stay with it).
//!
//! A conversation is a chain of turns, shared by every response that
//! continues it: storing a response costs its own turn, not the whole
//! history. The store holds the most recent [`MAX_STORED`] responses; an
//! older id is gone, as if deleted. Chat Completions stored with
//! `store: true` are kept the same way ([`CompletionStore`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde_json::Value;

/// Most responses kept; the oldest are forgotten first.
pub const MAX_STORED: usize = 4096;

/// One turn of a stored conversation and the turns before it.
#[derive(Debug, Default)]
pub struct Thread {
    /// This turn's input and output, as chat-shaped messages.
    pub messages: Vec<Value>,
    pub earlier: Option<Arc<Thread>>,
}

impl Thread {
    /// Every message from the first turn to this one.
    pub fn conversation(&self) -> Vec<Value> {
        let mut turns = vec![&self.messages];
        let mut earlier = self.earlier.as_deref();
        while let Some(turn) = earlier {
            turns.push(&turn.messages);
            earlier = turn.earlier.as_deref();
        }
        turns.into_iter().rev().flatten().cloned().collect()
    }
}

impl Drop for Thread {
    /// Unlinks a long chain turn by turn, not by recursion.
    fn drop(&mut self) {
        let mut earlier = self.earlier.take();
        while let Some(turn) = earlier {
            match Arc::try_unwrap(turn) {
                Ok(mut turn) => earlier = turn.earlier.take(),
                Err(_) => break,
            }
        }
    }
}

/// A stored response: its object as answered, and its conversation.
#[derive(Debug, Clone)]
pub struct Stored {
    pub body: Value,
    pub thread: Arc<Thread>,
}

/// A stored chat completion (`store: true` on Chat Completions): the
/// completion as answered, with its `metadata`, and the request's messages
/// as `GET /v1/chat/completions/{id}/messages` lists them.
#[derive(Debug, Clone)]
pub struct StoredCompletion {
    pub completion: Value,
    pub messages: Vec<Value>,
}

/// Objects a provider keeps, by id, listed in the order they were stored;
/// past [`MAX_STORED`] the oldest are forgotten first.
#[derive(Debug)]
pub struct Kept<T> {
    entries: HashMap<String, T>,
    /// Ids in the order they were stored.
    order: VecDeque<String>,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<T> Kept<T> {
    /// Keeps `stored` as `id`, forgetting the oldest past [`MAX_STORED`].
    pub fn insert(&mut self, id: String, stored: T) {
        if self.entries.insert(id.clone(), stored).is_none() {
            self.order.push_back(id);
        }
        while self.entries.len() > MAX_STORED {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.entries.remove(&oldest);
        }
    }

    pub fn get(&self, id: &str) -> Option<&T> {
        self.entries.get(id)
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut T> {
        self.entries.get_mut(id)
    }

    /// Forgets `id`; false when it was not stored.
    pub fn remove(&mut self, id: &str) -> bool {
        let removed = self.entries.remove(id).is_some();
        if removed {
            self.order.retain(|stored| stored != id);
        }
        removed
    }

    /// Every one kept, the oldest first.
    pub fn in_order(&self) -> impl Iterator<Item = &T> {
        self.order.iter().filter_map(|id| self.entries.get(id))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

/// The stored responses (see the module docs).
pub type ResponseStore = Kept<Stored>;

/// The stored chat completions.
pub type CompletionStore = Kept<StoredCompletion>;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn turn(text: &str, earlier: Option<Arc<Thread>>) -> Arc<Thread> {
        Arc::new(Thread {
            messages: vec![json!({"role": "user", "content": text})],
            earlier,
        })
    }

    #[test]
    fn threads_share_their_history_and_the_store_is_bounded() {
        let first = turn("one", None);
        let second = turn("two", Some(first.clone()));
        let texts: Vec<Value> = second
            .conversation()
            .iter()
            .map(|m| m["content"].clone())
            .collect();
        assert_eq!(texts, [json!("one"), json!("two")]);

        let mut store = ResponseStore::default();
        for n in 0..MAX_STORED + 3 {
            store.insert(
                format!("resp_{n}"),
                Stored {
                    body: json!({"n": n}),
                    thread: second.clone(),
                },
            );
        }
        assert_eq!(store.len(), MAX_STORED);
        assert!(store.get("resp_2").is_none(), "the oldest are gone");
        assert!(store.get("resp_3").is_some());
        assert!(store.remove("resp_3"));
        assert!(!store.remove("resp_3"));
        assert_eq!(store.len(), MAX_STORED - 1);

        // A long chain drops without deep recursion.
        let mut chain = turn("start", None);
        for _ in 0..200_000 {
            chain = turn("more", Some(chain));
        }
        drop(chain);
    }
}
