"""The admin console's templates and static assets (served by gateway/console). A package
only so that wheels ship it next to gateway/; nothing here is imported."""
