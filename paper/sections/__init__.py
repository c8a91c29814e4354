"""The paper's sections: one module a section, each a function ``<name>_section(v)`` that
reads its results files and fills the template's ``{{placeholders}}`` in ``v``."""
