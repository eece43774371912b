//! Who a bearer token is and what RBAC lets them do, asked of the API server: a `TokenReview`
//! and a `SubjectAccessReview`. ebb's APIs ask them for `--kube-auth` (the caching, the bounds
//! and the answers to the client are the API's, in the binary).

use std::collections::BTreeMap;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};

/// Who a token is, as Kubernetes told.
#[derive(Debug, Clone)]
pub struct User {
    /// The user name (`system:serviceaccount:NAMESPACE:NAME` for a ServiceAccount).
    pub name: String,
    /// The user's uid, if the authenticator gave one.
    pub uid: Option<String>,
    /// The user's groups.
    pub groups: Option<Vec<String>>,
    /// What else the authenticator said of the user.
    pub extra: Option<BTreeMap<String, Vec<String>>>,
}

/// Whose `token` is: `None` if the API server authenticates no one by it (the reason is
/// logged at debug level). `audiences` empty: the API server's own.
pub async fn user_of(
    client: &kube::Client,
    token: &str,
    audiences: &[String],
) -> Result<Option<User>, kube::Error> {
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: token.to_owned(),
            audiences: (!audiences.is_empty()).then(|| audiences.to_vec()),
        },
        ..Default::default()
    };
    let api: kube::Api<TokenReview> = kube::Api::all(client.clone());
    let answer = api.create(&Default::default(), &review).await?;
    let status = answer.status.unwrap_or_default();
    let user = match (status.authenticated, status.user) {
        (Some(true), Some(u)) => u.username.map(|name| User {
            name,
            uid: u.uid,
            groups: u.groups,
            extra: u.extra,
        }),
        _ => None,
    };
    if user.is_none() {
        tracing::debug!(
            why = status.error.as_deref().unwrap_or("not authenticated"),
            "a bearer token is no Kubernetes user's"
        );
    }
    Ok(user)
}

/// What a [`SubjectAccessReview`] asks: may the user do `verb` on `resource` of `group` in
/// `namespace`.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The API group.
    pub group: &'a str,
    /// The resource.
    pub resource: &'a str,
    /// The verb (`get`, `create`, ...).
    pub verb: &'a str,
    /// The namespace.
    pub namespace: &'a str,
}

/// Whether RBAC lets `user` do `request`.
pub async fn allowed(
    client: &kube::Client,
    user: &User,
    request: Request<'_>,
) -> Result<bool, kube::Error> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            uid: user.uid.clone(),
            groups: user.groups.clone(),
            extra: user.extra.clone(),
            resource_attributes: Some(ResourceAttributes {
                group: Some(request.group.to_owned()),
                resource: Some(request.resource.to_owned()),
                verb: Some(request.verb.to_owned()),
                namespace: Some(request.namespace.to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let api: kube::Api<SubjectAccessReview> = kube::Api::all(client.clone());
    let answer = api.create(&Default::default(), &review).await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}
