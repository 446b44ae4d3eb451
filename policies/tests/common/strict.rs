//! The strict test chat template (`tests/templates/strict.jinja`): renders a
//! conversation the way an open model's server does, or says why a strict
//! published template would refuse it.

use minijinja::{Environment, Error, ErrorKind, context};
use serde_json::Value;

const TEMPLATE: &str = include_str!("../templates/strict.jinja");

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_template("strict", TEMPLATE)
        .unwrap_or_else(|error| panic!("strict template: {error:#}"));
    env
}

thread_local! {
    static ENVIRONMENT: Environment<'static> = environment();
}

/// `messages` rendered by the strict template, or the template's complaint.
pub fn render(messages: &Value) -> Result<String, String> {
    ENVIRONMENT.with(|env| {
        let template = env
            .get_template("strict")
            .map_err(|error| error.to_string())?;
        template
            .render(context! { messages => messages })
            .map_err(|error| match error.detail() {
                Some(detail) => detail.to_owned(),
                None => error.to_string(),
            })
    })
}

/// Panics unless the strict template accepts `request`'s messages.
pub fn assert_renders(request: &Value) -> String {
    render(&request["messages"])
        .unwrap_or_else(|error| panic!("strict template refused {request}: {error}"))
}
