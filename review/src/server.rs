//! The HTTP side: routes, the authentication gate, security headers, and
//! the accept loop with its deadlines.
//!
//! Every response carries a strict Content-Security-Policy (no script at
//! all, styles from `/style.css` only, forms posting to this origin only),
//! `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer`,
//! `X-Frame-Options: DENY` and `Cache-Control: no-store` (pages show
//! decrypted prompts). Request bodies are read with a size limit and a
//! deadline; request heads have a deadline; a connection lives at most
//! [`CONNECTION_LIFETIME`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::header::{self, HeaderValue};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use canarygate_audit::time::now_ms;
use canarygate_audit::{Archive, AuditError, RecordId, ReviewVerdict, SampleKey, Snapshot};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::auth::{AdminToken, logout_cookie};
use crate::data::{self, Found};
use crate::filter::Filter;
use crate::pages::{self, MAX_NOTE_CHARS};

/// Largest form body accepted (login, review, logout).
pub const MAX_FORM_BYTES: usize = 16 * 1024;

/// How long a client may take to send a form body.
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);

/// How long a client may take to send a request head.
pub const HEADER_DEADLINE: Duration = Duration::from_secs(10);

/// The longest a connection stays open.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);

/// Connections served at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 64;

/// The Content-Security-Policy of every response.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
                       form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// What every handler shares.
pub struct AppState {
    /// The store, opened for writing (reviews).
    pub archive: Archive,
    /// The admin token and the keys derived from it.
    pub token: AdminToken,
    /// Decrypts samples; `None` shows encrypted samples as unreadable.
    pub sample_key: Option<SampleKey>,
    /// The variable the key is read from, named in messages.
    pub key_env: String,
}

type Shared = Arc<AppState>;

/// The routes, behind the authentication gate and the security headers.
pub fn router(state: Shared) -> Router {
    let gated = Router::new()
        .route("/", get(list))
        .route("/charts", get(charts))
        .route("/records/{id}", get(record))
        .route("/records/{id}/review", post(review))
        .route("/logout", post(logout))
        .route_layer(middleware::from_fn_with_state(state.clone(), gate));
    Router::new()
        .route("/login", get(login_form).post(login))
        .route("/style.css", get(style))
        .merge(gated)
        .fallback(not_found)
        .with_state(state)
        .layer(middleware::from_fn(security_headers))
}

/// Serves `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "review page: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "review page: {MAX_CONNECTIONS} connections open; closing a new one");
            continue;
        };
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(HEADER_DEADLINE)
                .keep_alive(true);
            let connection = http.serve_connection(TokioIo::new(stream), service);
            if let Ok(Err(error)) = tokio::time::timeout(CONNECTION_LIFETIME, connection).await {
                tracing::debug!(%peer, %error, "review page: connection ended");
            }
            drop(slot);
        });
    }
}

async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// Lets authenticated requests through; answers the rest with 401 and the
/// login form.
async fn gate(State(state): State<Shared>, request: Request, next: Next) -> Response {
    if state.token.authenticated(request.headers()) {
        next.run(request).await
    } else {
        unauthenticated()
    }
}

fn unauthenticated() -> Response {
    html(
        StatusCode::UNAUTHORIZED,
        pages::login(Some("Log in to see the review page.")),
    )
}

/// A request answered with an error page: its status and the reason shown.
struct Refusal {
    status: StatusCode,
    message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn page(self, state: &AppState) -> Response {
        error_page(state, self.status, &self.message)
    }
}

fn html(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body,
    )
        .into_response()
}

fn error_page(state: &AppState, status: StatusCode, message: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    html(
        status,
        pages::error(title, message, Some(&state.token.csrf())),
    )
}

fn see_other(location: &str) -> Response {
    (
        StatusCode::SEE_OTHER,
        [(header::LOCATION, location.to_owned())],
    )
        .into_response()
}

async fn style() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        pages::STYLE,
    )
        .into_response()
}

async fn not_found(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if !state.token.authenticated(&headers) {
        return unauthenticated();
    }
    error_page(&state, StatusCode::NOT_FOUND, "There is no such page.")
}

async fn login_form(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if state.token.authenticated(&headers) {
        return see_other("/");
    }
    html(StatusCode::OK, pages::login(None))
}

/// Reads an urlencoded form body within [`MAX_FORM_BYTES`] and
/// [`BODY_DEADLINE`]; an error is the page to answer with.
async fn read_form(request: Request) -> Result<Vec<(String, String)>, Refusal> {
    let form_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|mime| {
            mime.trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        });
    if !form_type {
        return Err(Refusal::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Forms are sent as application/x-www-form-urlencoded.",
        ));
    }
    let body = request.into_body();
    match tokio::time::timeout(BODY_DEADLINE, axum::body::to_bytes(body, MAX_FORM_BYTES)).await {
        Ok(Ok(bytes)) => Ok(form_urlencoded::parse(&bytes).into_owned().collect()),
        Ok(Err(_)) => Err(Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("The form is larger than {MAX_FORM_BYTES} bytes or was cut off."),
        )),
        Err(_) => Err(Refusal::new(
            StatusCode::REQUEST_TIMEOUT,
            "The form did not arrive in time.",
        )),
    }
}

fn field<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}

async fn login(State(state): State<Shared>, request: Request) -> Response {
    let pairs = match read_form(request).await {
        Ok(pairs) => pairs,
        Err(refusal) => return refusal.page(&state),
    };
    match field(&pairs, "token") {
        Some(token) if state.token.token_matches(token) => {
            let mut response = see_other("/");
            if let Ok(cookie) = HeaderValue::from_str(&state.token.login_cookie()) {
                response.headers_mut().insert(header::SET_COOKIE, cookie);
            }
            response
        }
        _ => {
            tracing::warn!("review page: a login with a wrong token was refused");
            html(
                StatusCode::UNAUTHORIZED,
                pages::login(Some("That is not the admin token.")),
            )
        }
    }
}

/// Checks the form's CSRF field; the error is the 403 page.
fn check_csrf(state: &AppState, pairs: &[(String, String)]) -> Result<(), Refusal> {
    match field(pairs, "csrf") {
        Some(csrf) if state.token.csrf_matches(csrf) => Ok(()),
        _ => Err(Refusal::new(
            StatusCode::FORBIDDEN,
            "The form's CSRF token is missing or wrong: reload the page and try again.",
        )),
    }
}

async fn logout(State(state): State<Shared>, request: Request) -> Response {
    let headers = request.headers().clone();
    let pairs = match read_form(request).await {
        Ok(pairs) => pairs,
        Err(refusal) => return refusal.page(&state),
    };
    if let Err(refusal) = check_csrf(&state, &pairs) {
        return refusal.page(&state);
    }
    state.token.log_out(&headers);
    let mut response = see_other("/login");
    if let Ok(cookie) = HeaderValue::from_str(&logout_cookie()) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

/// Runs `read` on a fresh snapshot off the async threads. A store error is
/// a 500 page; a panic inside redb (a file damaged behind its back) too.
async fn with_snapshot<T: Send + 'static>(
    state: &Shared,
    read: impl FnOnce(&AppState, &Snapshot) -> Result<T, AuditError> + Send + 'static,
) -> Result<T, Refusal> {
    let shared = state.clone();
    let outcome = tokio::task::spawn_blocking(move || {
        let snapshot = shared.archive.snapshot()?;
        read(&shared, &snapshot)
    })
    .await;
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => {
            tracing::error!(%error, "review page: reading the audit store failed");
            Err(Refusal::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                error.to_string(),
            ))
        }
        Err(_) => Err(Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The store file is damaged and cannot be read.",
        )),
    }
}

fn parse_filter(uri: &Uri) -> Result<Filter, Refusal> {
    let pairs = Query::<Vec<(String, String)>>::try_from_uri(uri)
        .map_err(|rejection| Refusal::new(StatusCode::BAD_REQUEST, rejection.body_text()))?
        .0;
    Filter::parse(&pairs, now_ms())
        .map_err(|error| Refusal::new(StatusCode::BAD_REQUEST, error.to_string()))
}

async fn list(State(state): State<Shared>, uri: Uri) -> Response {
    listing_page(&state, &uri, pages::list).await
}

async fn charts(State(state): State<Shared>, uri: Uri) -> Response {
    listing_page(&state, &uri, pages::charts).await
}

/// A page over the records the query's filter selects (the list, the
/// charts), drawn by `render`.
async fn listing_page(
    state: &Shared,
    uri: &Uri,
    render: fn(&Filter, &data::Listing, &str) -> String,
) -> Response {
    let filter = match parse_filter(uri) {
        Ok(filter) => filter,
        Err(refusal) => return refusal.page(state),
    };
    let read = filter.clone();
    match with_snapshot(state, move |_, snapshot| data::list(snapshot, &read)).await {
        Ok(listing) => html(
            StatusCode::OK,
            render(&filter, &listing, &state.token.csrf()),
        ),
        Err(refusal) => refusal.page(state),
    }
}

fn record_id(text: &str) -> Result<RecordId, Refusal> {
    text.parse::<RecordId>().map_err(|_| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            "A record id is a positive whole number.",
        )
    })
}

async fn record(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    let id = match record_id(&id) {
        Ok(id) => id,
        Err(refusal) => return refusal.page(&state),
    };
    let found = with_snapshot(&state, move |state, snapshot| {
        data::record(snapshot, id, state.sample_key.as_ref(), &state.key_env)
    })
    .await;
    let csrf = state.token.csrf();
    match found {
        Ok(Found::Request(detail)) => html(StatusCode::OK, pages::record(&detail, &csrf)),
        Ok(Found::Other(record, line)) => {
            html(StatusCode::OK, pages::other_record(&record, &line, &csrf))
        }
        Ok(Found::Missing) => error_page(
            &state,
            StatusCode::NOT_FOUND,
            &format!("There is no record {id}."),
        ),
        Err(refusal) => refusal.page(&state),
    }
}

async fn review(State(state): State<Shared>, Path(id): Path<String>, request: Request) -> Response {
    let id = match record_id(&id) {
        Ok(id) => id,
        Err(refusal) => return refusal.page(&state),
    };
    let pairs = match read_form(request).await {
        Ok(pairs) => pairs,
        Err(refusal) => return refusal.page(&state),
    };
    if let Err(refusal) = check_csrf(&state, &pairs) {
        return refusal.page(&state);
    }
    let verdict = match field(&pairs, "verdict") {
        Some("ok") => ReviewVerdict::Ok,
        Some("bad") => ReviewVerdict::Bad,
        _ => {
            return error_page(
                &state,
                StatusCode::BAD_REQUEST,
                "Choose ok or bad before recording the review.",
            );
        }
    };
    let note = field(&pairs, "note").map(|note| note.trim().to_owned());
    if note
        .as_ref()
        .is_some_and(|note| note.chars().count() > MAX_NOTE_CHARS)
    {
        return error_page(
            &state,
            StatusCode::BAD_REQUEST,
            &format!("The note is longer than {MAX_NOTE_CHARS} characters."),
        );
    }
    let shared = state.clone();
    let written =
        tokio::task::spawn_blocking(move || shared.archive.review(id, verdict, note)).await;
    match written {
        Ok(Ok(review_id)) => {
            tracing::info!(
                record = id,
                review = review_id,
                "review page: review recorded"
            );
            see_other(&format!("/records/{id}"))
        }
        Ok(Err(AuditError::NotFound(message))) => {
            error_page(&state, StatusCode::NOT_FOUND, &message)
        }
        Ok(Err(AuditError::InvalidArgument(message))) => {
            error_page(&state, StatusCode::CONFLICT, &message)
        }
        Ok(Err(error)) => {
            tracing::error!(%error, "review page: writing a review failed");
            error_page(
                &state,
                StatusCode::INTERNAL_SERVER_ERROR,
                &error.to_string(),
            )
        }
        Err(_) => error_page(
            &state,
            StatusCode::INTERNAL_SERVER_ERROR,
            "The store file is damaged and cannot be written.",
        ),
    }
}
