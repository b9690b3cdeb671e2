"""Domain errors; the gateway maps each to its HTTP status."""


class DomainError(Exception):
    """Base for errors the business domain raises on purpose."""


class NotFoundError(DomainError):
    pass


class ConflictError(DomainError):
    pass


class InvalidInputError(DomainError):
    pass
