pub struct PageStore;
