"""The contract between the compiler and the runtime: what both sides import, so that neither
restates a fact of the other.  The hook catalogue (`hooks`: every context field, where each
hook fires, what each decision does), the ids written to the manifest (`ids`), routing and
port numbering (`topology`), which movement a transfer belongs to (`flows`), the packing of
hook contexts (`context`), the properties a declaration takes (`schema`), and the bundle
itself: the manifest's schema (`manifest_schema`), an island's runtime artifact
(`runtime_json`) and the folder, written and loaded (`bundle`)."""
